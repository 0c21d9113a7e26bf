"""``--calibrate``'s arithmetic by hand: the expert-load imbalance, the fed shape, and the mfu fit
inverting the planner's own time model. The calibration run itself: tests/e2e/test_plan_calibrate.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from planning.calibrate import (
    MeasuredStep,
    calibration_overrides,
    expert_imbalance,
    fed_options,
    fit_mfu,
)
from planning.hardware import gpu_spec
from planning.job import compose_job
from planning.planner import plan_layout


def test_expert_imbalance_by_hand():
    # one step, two layers of 4 experts
    loads = [[[0.4, 0.1, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]]]
    assert expert_imbalance(loads, 1) == pytest.approx(1.0)
    # ep 2: layer 0 ranks hold 0.5 / 0.5 -> 1.0; layer 1 -> 1.0
    assert expert_imbalance(loads, 2) == pytest.approx(1.0)
    # ep 4: layer 0 -> 4 x 0.4 = 1.6; layer 1 -> 1.0; mean 1.3
    assert expert_imbalance(loads, 4) == pytest.approx(1.3)
    # a second step averages in: ep 2 with [0.6 + 0.2 | 0.1 + 0.1] -> 2 x 0.8 = 1.6 (twice)
    two = [*loads, [[0.6, 0.2, 0.1, 0.1], [0.6, 0.2, 0.1, 0.1]]]
    assert expert_imbalance(two, 2) == pytest.approx((1.0 + 1.0 + 1.6 + 1.6) / 4)
    with pytest.raises(ValueError, match="do not split over ep=3"):
        expert_imbalance(loads, 3)


def _job(*overrides: str, gpus: int = 2):
    return compose_job(["parallel=ep2", "trainer.updates_per_rollout=2", *overrides], gpus=gpus, prompt_tokens=8)


def test_fed_options_plan_what_the_step_fed():
    job = _job()
    # 2 dp ranks fed 48 rows of 10 tokens over 2 updates, 3 micro-batches per rank and update
    step = MeasuredStep(step=2, seconds={}, fed_rows=48, fed_tokens=480, micro_batches_per_rank=6)
    options = fed_options(job, step)
    # per update 24 rows, 12 per rank, in 3 micro-batches of 4 rows
    assert options.seq_len == 10
    assert options.micro_batch_tokens == 4 * 10
    assert options.global_batch_tokens == 4 * 3 * 2 * 10
    assert options.rollout is not None and options.rollout.prompt_tokens == 10 + 1 - job.options.rollout.response_tokens


@pytest.mark.parametrize("parallel", ["parallel=ep2", "parallel=tp2"])
def test_mfu_fit_inverts_the_planned_update_time(parallel):
    """A measured update exactly as the planner predicts at mfu 0.3 fits back to 0.3, with the
    communication term (M > 0 on two ranks) left out of the compute."""
    job = _job(parallel)
    spec = replace(gpu_spec("h100"), bf16_tflops=0.1, mfu=0.3, nvlink_bandwidth=2e9, link_efficiency=0.5)
    step = MeasuredStep(step=2, seconds={}, fed_rows=64, fed_tokens=64 * 12, micro_batches_per_rank=2)
    plan = plan_layout(job.config.model, job.layout, fed_options(job, step), spec, validated=True)
    assert sum(plan.time.comm_s.values()) > 0
    update_s = plan.time.total_s * job.options.updates_per_rollout
    mfu, why = fit_mfu(job, step, spec, update_s)
    assert why == "" and mfu == pytest.approx(0.3, rel=1e-9)
    # a measured time below the planned communication cannot be fitted, and says so
    mfu, why = fit_mfu(job, step, spec, 1e-9)
    assert mfu is None and "communication" in why


def test_expert_imbalance_scales_the_expert_flops_only():
    from planning.activations import MicroBatchShape
    from planning.step_time import forward_flops

    job = _job()
    cfg, layout = job.config.model, job.layout
    micro = MicroBatchShape(4, 16)
    base, skewed = forward_flops(cfg, layout, micro, 0), forward_flops(cfg, layout, micro, 0, expert_imbalance=1.5)
    # the routed-expert GEMMs: 6 T k h F per MoE layer, T = 64 tokens (no sequence parallelism at tp 1)
    moe_layers = cfg.num_layers - len(cfg.dense_layers)
    experts = moe_layers * 6 * 64 * cfg.top_k * cfg.hidden_size * cfg.moe_intermediate_size
    assert skewed - base == pytest.approx(0.5 * experts)


def test_calibration_overrides_compose_with_the_job():
    """The keys the calibration run sets exist in the schema (a renamed key fails here, not in a run)."""
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config

    cfg = to_train_config(compose(["parallel=ep2", *calibration_overrides(Path("/tmp/x"), 4)]))
    assert cfg.trainer.steps == 4 and cfg.trainer.eval_every == 0
    assert cfg.routing.every_n_steps == 3 and list(cfg.routing.kinds) == ["update"]


def test_name_mode_refuses_calibrate():
    """A bare model name has no job to run: --calibrate says so instead of planning without it."""
    import importlib.util

    tool = Path(__file__).resolve().parents[4] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", tool)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit, match="config overrides"):
        module.main(["qwen3_30b_a3b", "tp4_ep8", "--calibrate"])
