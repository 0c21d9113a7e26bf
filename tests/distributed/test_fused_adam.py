"""build_optimizer switches megatron's torch-Adam fallback (no TE, no Apex) to torch's fused kernel,
and the fused update equals the per-tensor loop megatron would otherwise run, to float rounding.

Two optimizers over two copies of the same tiny MoE (same initial weights, same batch, so the same
gradients): ours from ``build_optimizer``, and megatron's own ``get_megatron_optimizer`` with the same
settings and megatron's scheduler (which sets each group's weight decay), unswitched. Three steps,
weight decay on, so both param groups are exercised. Loop against loop gives exactly 0 here."""

from __future__ import annotations

import pytest

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import fixed_batch, random_hf_state, tiny_test_config

pytestmark = pytest.mark.distributed


def fused_vs_loop_worker(ctx):
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import get_megatron_optimizer

    from gspo_megatron.policy.config import OptimizerSection
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.optimizer import build_optimizer, build_scheduler, optimizer_config
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    cfg = tiny_test_config()
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    section = OptimizerSection(lr=0.01, weight_decay=0.1, warmup_steps=0, decay_style="constant")
    models, optimizers = [], []
    for fused in (True, False):
        model = build_model(cfg, layout)
        load_hf_weights(model, cfg, random_hf_state(cfg, seed=3), mesh)
        ddp = wrap_for_training(model, model.config)
        if fused:
            optimizer, _ = build_optimizer(ddp, section, total_updates=3)
        else:
            optimizer = get_megatron_optimizer(optimizer_config(ddp, section), [ddp])
            build_scheduler(optimizer, section, total_updates=3)  # sets lr and per-group weight decay
        models.append(ddp)
        optimizers.append(optimizer)
    initial = {k: v.detach().clone() for k, v in models[0].module.named_parameters()}
    inputs, targets, weights = fixed_batch(cfg)
    batch = [MicroBatch(tokens=inputs, targets=targets, weights=weights)]

    def loss(logits, mb):
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), mb.targets)
        return -(mb.weights * logp).sum() / mb.weights.sum(), {}

    for _ in range(3):
        for ddp, optimizer in zip(models, optimizers, strict=True):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            run_schedule([ddp], batch, loss, forward_only=False)
            stepped, _, _ = optimizer.step()
            assert stepped
    flags = [
        [(group["fused"], group["foreach"]) for group in optimizer.optimizer.param_groups] for optimizer in optimizers
    ]
    fused_params = dict(models[0].module.named_parameters())
    loop_params = dict(models[1].module.named_parameters())
    assert fused_params.keys() == loop_params.keys()
    max_diff = max((fused_params[k] - loop_params[k]).abs().max().item() for k in fused_params)
    moved = max((fused_params[k] - initial[k]).abs().max().item() for k in fused_params)
    return {"flags": flags, "max_diff": max_diff, "moved": moved}


def test_build_optimizer_uses_fused_adam_equal_to_the_loop():
    (result,) = run_distributed(fused_vs_loop_worker, 1, timeout=300)
    fused_flags, loop_flags = result["flags"]
    assert fused_flags and all(flag == (True, False) for flag in fused_flags)
    assert all(not fused for fused, _ in loop_flags)  # megatron's own build: the per-tensor loop
    # three Adam steps of lr 0.01 from the same gradients: float rounding only
    assert result["moved"] > 0.01  # the weights did move (Adam's first steps move each by ~lr)
    assert result["max_diff"] < 1e-5
