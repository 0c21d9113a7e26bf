"""Tiny models, random HF-named weights and a per-rank worker for layout-equivalence tests."""

from __future__ import annotations

import torch

from gspo_megatron.models.config import MoEModelConfig
from gspo_megatron.models.conversion import export_hf_state_dict, gradient_of, hf_shapes, load_hf_weights


def tiny_test_config(**overrides) -> MoEModelConfig:
    """2 MoE layers, 4 experts top-2, GQA 4q/2kv heads; divisible by tp=2, ep=2, pp=2."""
    values = dict(
        vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        head_dim=8, num_experts=4, top_k=2, moe_intermediate_size=16, max_position_embeddings=64,
    )
    values.update(overrides)
    return MoEModelConfig(**values).validate()


def random_hf_state(cfg: MoEModelConfig, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Random weights under HF checkpoint names; norms near 1, routers with spread-out logits."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in hf_shapes(cfg).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            state[name] = scale * torch.randn(shape, generator=generator)
    return state


def fixed_batch(cfg: MoEModelConfig, batch: int = 4, seq: int = 12, seed: int = 7):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=generator)
    weights = torch.rand(batch, seq, generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), weights


def model_layout_worker(ctx, cfg: MoEModelConfig, state: dict, layout_kwargs: dict):
    """Build the layout, load ``state``, run forward+backward of a weighted log-likelihood loss.

    Returns this rank's exported weights, the log-probs it holds (last stage, by dp rank) and the
    gradients gathered to HF names.
    """
    from megatron.core import tensor_parallel

    from gspo_megatron.models.builder import build_model
    from gspo_megatron.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.parallel.mesh import initialize_parallel

    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    mesh = initialize_parallel(layout, seed=11)
    model = build_model(cfg, layout)
    load_hf_weights(model, cfg, state, mesh)
    exported = export_hf_state_dict(model, cfg, mesh)
    ddp = wrap_for_training(model, model.config)
    ddp.zero_grad_buffer()

    inputs, targets, weights = fixed_batch(cfg)
    total_tokens = weights.numel()
    rows = inputs.shape[0] // layout.dp
    sl = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    per_micro = max(1, rows // 2)
    micro_batches = [
        {"tokens": inputs[sl][i : i + per_micro], "targets": targets[sl][i : i + per_micro],
         "weights": weights[sl][i : i + per_micro]}
        for i in range(0, rows, per_micro)
    ]

    def loss_callback(logits, batch):
        # logits [b, s, V/tp]; megatron's vocab-parallel CE gives -log p(target) per token.
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch["targets"])
        loss = -(batch["weights"] * logp).sum() / total_tokens
        return loss, {"log_probs": logp.detach(), "loss": loss.detach()}

    metrics = run_schedule([ddp], micro_batches, loss_callback, forward_only=False)
    grads = export_hf_state_dict(model, cfg, mesh, tensor_of=gradient_of)
    log_probs = {}
    loss = torch.tensor(0.0)
    if metrics:
        log_probs[mesh.dp_rank] = torch.cat([m["log_probs"] for m in metrics], dim=0)
        loss = sum(m["loss"] for m in metrics)
    mesh.destroy()
    return {"exported": exported, "log_probs": log_probs, "grads": grads, "loss": loss}
