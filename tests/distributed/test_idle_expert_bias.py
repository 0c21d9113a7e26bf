"""Routers without expert bias run megatron's ``_apply_expert_bias`` uncompiled (policy/models/idle_expert_bias.py).

On one gloo rank, a Qwen3-MoE's training forward (gradients on, where the function would act if it could): its
routers hold the uncompiled function, dynamo traces no frame, and the logits are bit for bit those of the same
model calling megatron's compiled function (the binding removed). GLM-4.5's routers (expert bias on) keep the
compiled function, and its forward still counts every routed token into ``local_tokens_per_expert``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import fixed_batch, random_hf_state, tiny_family_config

pytestmark = pytest.mark.distributed


def _routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def idle_expert_bias_worker(ctx, family: str) -> dict:
    import torch._dynamo.utils
    from megatron.core.transformer.moe.router import TopKRouter

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    cfg = tiny_family_config(family)
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    model = build_model(cfg, layout)
    load_hf_weights(model, cfg, random_hf_state(cfg, seed=3), mesh)
    tokens, _, _ = fixed_batch(cfg)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    routers = _routers(model)
    plain = inspect.unwrap(TopKRouter._apply_expert_bias)

    def forward() -> tuple[torch.Tensor, int]:
        frames = torch._dynamo.utils.counters["frames"]["total"]
        logits = model(tokens, positions, attention_mask=None)
        logits.sum().backward()  # a training forward: gradients on, as in the update
        model.zero_grad()
        return logits.detach(), torch._dynamo.utils.counters["frames"]["total"] - frames

    counted_before = [r.local_tokens_per_expert.clone() for r in routers if r.enable_expert_bias]
    logits, traced = forward()
    counted = [r.local_tokens_per_expert - b for r, b in zip(routers, counted_before, strict=False)]
    result = {
        "routers": len(routers),
        "bound_plain": sum(getattr(r.__dict__.get("_apply_expert_bias"), "__func__", None) is plain for r in routers),
        "expert_bias": sum(r.enable_expert_bias for r in routers),
        "traced_frames": traced,
        "tokens_counted": [float(c.sum()) for c in counted],
        "routed_slots": tokens.numel() * cfg.top_k,
    }
    if result["bound_plain"]:
        for router in routers:
            del router._apply_expert_bias  # megatron's compiled function again
        compiled_logits, compiled_traced = forward()
        result["equal_to_compiled"] = torch.equal(logits, compiled_logits)
        result["compiled_traced_frames"] = compiled_traced
    mesh.destroy()
    return result


def test_routers_without_expert_bias_run_the_function_uncompiled_with_the_same_logits():
    (result,) = run_distributed(idle_expert_bias_worker, 1, "qwen3_moe")
    assert result["routers"] > 0 and result["expert_bias"] == 0
    assert result["bound_plain"] == result["routers"]
    assert result["traced_frames"] == 0  # dynamo never entered
    assert result["equal_to_compiled"]
    assert result["compiled_traced_frames"] > 0  # the control: megatron's function is compiled


def test_routers_with_expert_bias_keep_megatrons_compiled_function():
    (result,) = run_distributed(idle_expert_bias_worker, 1, "glm4_moe")
    assert result["routers"] > 0 and result["expert_bias"] == result["routers"]
    assert result["bound_plain"] == 0
    # every routed (token, slot) counted by each router's bias update (dense first layers have no router)
    assert result["tokens_counted"] == [float(result["routed_slots"])] * result["routers"]
