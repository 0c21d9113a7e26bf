"""The planner's arithmetic by hand, its refusals through the trainer's validation, and the CLI.

Exactness against megatron's real allocations and gloo's real traffic is checked in
tests/distributed/test_planner_matches_megatron.py; activation memory in tools/bench_plan_memory.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gspo_megatron.models.config import MoEModelConfig, preset
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.planning.hardware import gpu_spec
from gspo_megatron.planning.parameters import ParamSpec, buffer_layout, owned_elements, state_bytes
from gspo_megatron.planning.planner import PlanError, PlanOptions, plan_layout, rank_layouts
from gspo_megatron.testing.model_fixtures import tiny_test_config


def test_buffer_padding_replays_megatron_by_hand():
    # Parameters go in reverse order: b (30) at [0, 30); a starts at the next multiple of 64: [64, 164);
    # the bucket ends at the next multiple of lcm(dp=2, 128) = 128: 256 elements.
    params = [ParamSpec("a", 100, False), ParamSpec("b", 30, False)]
    plain = buffer_layout(params, dp=2, distributed_optimizer=False)
    assert plain.numel == 130 and plain.buckets == ((0, 130),)
    sharded = buffer_layout(params, dp=2, distributed_optimizer=True)
    assert sharded.numel == 256
    assert sharded.param_ranges == ((0, 30, 0), (64, 164, 0))
    # rank 0 owns [0, 128): all of b and 64 of a; rank 1 owns [128, 256): the last 36 of a.
    assert owned_elements(sharded, 0) == 94 and owned_elements(sharded, 1) == 36


def test_state_bytes_by_hand_for_the_tiny_pp_stage():
    cfg = tiny_test_config()  # h 32, V 32, 2 layers, 4 heads / 2 kv of 8, 4 experts of 16
    layout = ParallelLayout(pp=2, world_size=2).validate(cfg)
    layer = 32 + 32 + 32 * 32 + (4 + 4) * 8 * 32 + 8 + 8 + 4 * 32 + 4 * (2 * 16 * 32 + 32 * 16)
    first = 32 * 32 + layer  # embedding + layer 0
    got = state_bytes(cfg, layout, 0, dtype="float32", distributed_optimizer=False)
    assert got.parameters == got.gradients == first * 4
    assert got.optimizer == 2 * first * 4  # Adam moments, no master copy for fp32
    bf16 = state_bytes(cfg, layout, 0, dtype="bfloat16", distributed_optimizer=False)
    # every weight in bf16 (the RMSNorm weights too); each gets an fp32 master copy beside Adam's moments
    assert bf16.parameters == first * 2
    assert bf16.optimizer == 2 * first * 4 + first * 4


def test_trainer_validation_refuses_the_layout():
    model = preset("qwen3_30b_a3b")
    with pytest.raises(ValueError, match="etp\\*ep\\*pp = 4\\*8\\*1 = 32 does not divide the world size 8"):
        plan_layout(model, ParallelLayout(tp=4, ep=8, world_size=8), PlanOptions(), gpu_spec("h100"))


def test_trainer_batch_rules_refuse_a_batch_the_layout_cannot_split():
    model = preset("qwen3_30b_a3b")
    options = PlanOptions(seq_len=8192, micro_batch_tokens=8192, global_batch_tokens=8 * 8192, group_size=8)
    with pytest.raises(PlanError, match="not divisible by the data-parallel size 16"):
        plan_layout(model, ParallelLayout(tp=1, ep=16, world_size=16), options, gpu_spec("h100"))


def test_ranking_orders_fitting_layouts_by_step_time():
    model = MoEModelConfig(
        vocab_size=4096,
        hidden_size=512,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=64,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=256,
    )
    options = PlanOptions(seq_len=1024, micro_batch_tokens=2048, global_batch_tokens=16 * 1024, group_size=4)
    fitting, too_big = rank_layouts(model, 4, options, gpu_spec("h100"))
    assert fitting and not too_big
    times = [plan.time.total_s for plan in fitting]
    assert times == sorted(times)
    tiny_gpu = gpu_spec("h100", memory_bytes=1e6)  # nothing fits in 1 MB
    fitting, too_big = rank_layouts(model, 4, options, tiny_gpu)
    assert not fitting and too_big


def test_plan_cli_prints_a_layout_and_refuses_a_bad_one(capsys):
    tool = Path(__file__).resolve().parents[3] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", tool)
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)
    main = plan_tool.main

    assert main(["qwen3_235b_a22b", "tp4_ep16_etp1", "--gpus", "64", "--recompute"]) == 0
    out = capsys.readouterr().out
    assert "235.09B parameters, 22.19B active" in out and "peak total" in out
    assert main(["qwen3_30b_a3b", "tp4_ep8", "--gpus", "8"]) == 2
    assert "refused: etp*ep*pp" in capsys.readouterr().out


@pytest.mark.parametrize("replay", ["none", "old_policy", "rollout"])
def test_every_routing_replay_mode_plans_and_replay_buffers_cost_memory(replay):
    """The planner takes the trainer's own mode names (tools/plan.py once offered "old", which the
    trainer's validation refused for every layout: the plan came out empty, silently)."""
    model = tiny_test_config(num_layers=4)
    layout = ParallelLayout(ep=2, world_size=2)
    options = PlanOptions(seq_len=32, micro_batch_tokens=64, global_batch_tokens=256, group_size=4)
    plan = plan_layout(model, layout, PlanOptions(**{**options.__dict__, "routing_replay": replay}), gpu_spec("h100"))
    assert (plan.memory.routing_replay > 0) == (replay != "none")
    tool = Path(__file__).resolve().parents[3] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", tool)
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)
    assert plan_tool.main(["qwen3_30b_a3b", "tp4_ep8_etp1", "--gpus", "8", "--routing-replay", replay]) == 0


def test_weight_sync_plan_packs_the_export_greedily_and_bounds_the_driver_by_hand():
    from gspo_megatron.planning.comm import weight_sync_plan
    from gspo_megatron.testing.model_fixtures import tiny_test_config

    cfg = tiny_test_config()  # vocab 32, hidden 32, 2 layers, q 4 x 8, kv 2 x 8, 4 experts of 16
    # bf16 bytes: embedding 2048; per layer: norms 64 + 64, q 2048, k 1024, v 1024, o 2048, q/k norms
    # 16 + 16, router 256, experts 4 x (1024 + 1024 + 1024) = 18848; final norm 64; head 2048
    plan = weight_sync_plan(cfg, bucket_bytes=4096, link_bytes_per_s=1000.0)
    assert plan.bytes == 2048 + 2 * 18848 + 64 + 2048 == cfg.parameter_count()["total"] * 2
    # walking the names: [embed, ln] | [q] ... a bucket closes when the next tensor would overflow 4096
    assert plan.buckets == 12
    assert plan.driver_extra_bytes == 4096 + 2048  # a bucket being filled + the largest tensor
    assert plan.seconds == pytest.approx(41856 / 1000.0)
    whole = weight_sync_plan(cfg, bucket_bytes=10**9, link_bytes_per_s=1000.0)
    assert whole.buckets == 1 and whole.driver_extra_bytes == 10**9 + 2048
    tiny = weight_sync_plan(cfg, bucket_bytes=1, link_bytes_per_s=1000.0)  # every tensor alone
    assert tiny.buckets == 3 + 2 * (9 + 4 * 3)  # embedding, norm, head; per layer 9 + 3 per expert
