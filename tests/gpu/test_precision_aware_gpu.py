"""megatron's precision-aware optimizer on the device (TransformerEngine's FusedAdam), which needs CUDA and TE:
with float32 state it steps like the plain distributed optimizer; with bfloat16 moments
(``optimizer.exp_avg_dtype`` / ``exp_avg_sq_dtype``) within the tolerance derived below; and the optimizer
state it allocates is what the planner plans for those dtypes.

The tolerance for bfloat16 moments, derived (Adam, decoupled weight decay; beta1 = 0.9, beta2 = 0.98):
m_t = b1 m_{t-1} + (1 - b1) g_t and v_t likewise are stored rounded to bf16, each rounding a relative error of at
most u = 2^-8 (8 significant bits); the stored m_t then carries at most t rounding errors of its history, and v_t
too, so the update lr * m^_t / sqrt(v^_t) is off by at most lr * B_t * (t u + t u / 2) to first order (the square
root halves v's relative error), where B_t bounds |m^_t / sqrt(v^_t)| by Cauchy-Schwarz over the t gradients:
B_t = (1 - b1) / (1 - b1^t) * sqrt(sum_{j<t} (b1^2 / b2)^j) * sqrt((1 - b2^t) / (1 - b2)) (B_1 = 1). Over T steps
the fp32 master weights differ by at most lr * sum_t 1.5 t u B_t, twice that for the second-order terms (the
gradients of slightly different weights; eps); the bf16 weights compared here were rounded from those masters,
which adds at most one bf16 ulp of the weight, 2^-7 |w|.

Skipped without CUDA and TransformerEngine.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from gspo_megatron.testing.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
        reason="needs CUDA and TransformerEngine (megatron's precision-aware optimizer is TE's FusedAdam)",
    ),
]

STEPS = 3
LR = 0.01
BETA1, BETA2 = 0.9, 0.98
BF16_U = 2.0**-8


def adam_ratio_bound(t: int) -> float:
    """B_t of the module docstring: a bound on |m^_t / sqrt(v^_t)| after t steps."""
    ratio = BETA1**2 / BETA2
    return (
        (1 - BETA1)
        / (1 - BETA1**t)
        * math.sqrt(sum(ratio**j for j in range(t)))
        * math.sqrt((1 - BETA2**t) / (1 - BETA2))
    )


def master_weight_bound() -> float:
    return 2 * LR * sum(1.5 * t * BF16_U * adam_ratio_bound(t) for t in range(1, STEPS + 1))


def precision_aware_worker(ctx, precision_aware: bool, moment_dtype: str) -> dict:
    from megatron.core import tensor_parallel

    from gspo_megatron.contracts.micro_batch import MicroBatch
    from gspo_megatron.policy.config import OptimizerSection
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import export_hf_state_dict, load_hf_weights
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.optimizer import allocate_optimizer_state, build_optimizer
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.testing.model_fixtures import fixed_batch, random_hf_state, tiny_test_config

    cfg = tiny_test_config()
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    model = build_model(cfg, layout, params_dtype=torch.bfloat16, layer_spec="portable")
    load_hf_weights(model, cfg, random_hf_state(cfg, seed=3), mesh)
    section = OptimizerSection(
        lr=LR,
        weight_decay=0.1,
        warmup_steps=0,
        decay_style="constant",
        adam_beta1=BETA1,
        adam_beta2=BETA2,
        distributed="true",
        precision_aware=precision_aware,
        exp_avg_dtype=moment_dtype,
        exp_avg_sq_dtype=moment_dtype,
    )
    ddp = wrap_for_training(model, model.config, use_distributed_optimizer=True)
    optimizer, scheduler = build_optimizer(ddp, section, total_updates=STEPS)
    allocate_optimizer_state(optimizer)
    state_bytes = sum(
        t.numel() * t.element_size()
        for part in getattr(optimizer, "chained_optimizers", [optimizer])
        for state in part.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    main_shards = sum(
        p.numel() * p.element_size()
        for part in getattr(optimizer, "chained_optimizers", [optimizer])
        for group in getattr(part, "shard_fp32_from_float16_groups", [])
        for p in group
    )
    inputs, targets, weights = fixed_batch(cfg)
    batch = [MicroBatch(tokens=inputs.cuda(), targets=targets.cuda(), weights=weights.cuda())]

    def loss(logits, mb):
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), mb.targets)
        return -(mb.weights * logp).sum() / mb.weights.sum(), {}

    for _ in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run_schedule(ddp, batch, loss, forward_only=False)
        stepped, _, _ = optimizer.step()
        scheduler.step(1)
        assert stepped
    out = {
        "weights": {k: v.float().cpu() for k, v in export_hf_state_dict(model, cfg, mesh).items()},
        "optimizer_bytes": state_bytes + main_shards,
    }
    mesh.destroy()
    return out


def test_bf16_moments_stay_within_the_derived_bound_and_fp32_states_match_the_plain_optimizer():
    (plain,) = run_distributed(precision_aware_worker, 1, False, "float32", timeout=600)
    (fp32,) = run_distributed(precision_aware_worker, 1, True, "float32", timeout=600)
    (bf16,) = run_distributed(precision_aware_worker, 1, True, "bfloat16", timeout=600)
    bound = master_weight_bound()
    for name, expected in plain["weights"].items():
        assert (fp32["weights"][name] - expected).abs().max().item() <= 2.0**-7 * expected.abs().max().item(), name
        allowed = bound + 2.0**-7 * expected.abs()
        assert ((bf16["weights"][name] - expected).abs() <= allowed).all(), name
    assert bf16["optimizer_bytes"] < fp32["optimizer_bytes"]


@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_the_planned_optimizer_bytes_equal_the_allocated_ones(moment_dtype):
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.testing.model_fixtures import tiny_test_config
    from planning.parameters import StateWidths, state_bytes

    (built,) = run_distributed(precision_aware_worker, 1, True, moment_dtype, timeout=600)
    width = 2 if moment_dtype == "bfloat16" else 4
    cfg = tiny_test_config()
    planned = state_bytes(
        cfg,
        ParallelLayout(world_size=1).validate(cfg),
        0,
        dtype="bfloat16",
        distributed_optimizer=True,
        widths=StateWidths(master=4, exp_avg=width, exp_avg_sq=width),
    )
    assert planned.optimizer == built["optimizer_bytes"]
