"""Tiny models, random HF-named weights and a per-rank worker for layout-equivalence tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.models.conversion import export_hf_state_dict, gradient_of, hf_shapes, load_hf_weights

# The layouts every equivalence test compares with one rank (4 ranks at most: 2 cores).
EQUIVALENCE_LAYOUTS = {
    "tp2": dict(tp=2, world_size=2),
    "pp2": dict(pp=2, world_size=2),
    "ep2": dict(ep=2, world_size=2),
    "tp2_ep2": dict(tp=2, ep=2, world_size=4),
    "dp2": dict(world_size=2),
    # context parallel: each rank holds a load-balanced half of every sequence
    "cp2": dict(cp=2, world_size=2),
    "tp2_cp2": dict(tp=2, cp=2, world_size=4),
    "cp2_ep2": dict(cp=2, ep=2, world_size=2),
    "pp2_cp2": dict(pp=2, cp=2, world_size=4),
}


def tiny_test_config(**overrides) -> MoEModelConfig:
    """2 MoE layers, 4 experts top-2, GQA 4q/2kv heads; divisible by tp=2, ep=2, pp=2."""
    values: dict[str, Any] = dict(
        vocab_size=32,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=16,
        max_position_embeddings=64,
    )
    values.update(overrides)
    return MoEModelConfig(**values)


# GLM-4.5's and DeepSeek-V3's MoE: one dense layer, 8 experts in 2 groups (1 kept, top-2), sigmoid + expert
# bias, scaling, an un-gated shared expert
_SIGMOID_MOE: dict[str, Any] = dict(
    num_layers=4,
    dense_layers=[0],
    dense_intermediate_size=24,
    num_experts=8,
    shared_expert_intermediate_size=16,
    router_score="sigmoid",
    expert_bias=True,
    router_groups=2,
    router_group_topk=1,
    routed_scaling_factor=2.5,
)
# Each family's tiny model (core/model_families.py): what its architecture fixes, and its own features on.
FAMILY_TEST_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {},
    # q/k/v biases, a gated shared expert, top-k not renormalised
    "qwen2_moe": dict(qk_norm=False, qkv_bias=True, shared_expert_intermediate_size=24, norm_topk_prob=False),
    "mixtral": dict(qk_norm=False),
    # q/k norms over all heads' width (4 x 8 = hidden 32 for q, 2 x 8 for k), top-k not renormalised
    "olmoe": dict(norm_topk_prob=False),
    # with q/k norms and biases, RoPE on half of each head
    "glm4_moe": dict(_SIGMOID_MOE, qkv_bias=True, rotary_fraction=0.5),
    # with multi-latent attention: q and kv latents, 6 + 2 dims per head for the query/key, 8 for the value
    "deepseek_v3": dict(
        _SIGMOID_MOE,
        num_kv_heads=4,
        attention="mla",
        q_lora_rank=12,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=2,
        v_head_dim=8,
    ),
}


# The hybrid families' tiny model (Qwen3-Next, Qwen3.5): 2 gated DeltaNet layers then 1 gated full-attention
# layer (2 key heads x 8 for q and k, 4 value heads x 8, a 4-tap conv), 16 experts top-4 with a gated shared
# expert, RoPE on a quarter of each head. Kept apart from FAMILY_TEST_OVERRIDES: the engines, routing replay and
# layouts that iterate those do not build the hybrids yet.
_HYBRID: dict[str, Any] = dict(
    num_layers=3,
    linear_attention_layers=[0, 1],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    attention_output_gate=True,
    rotary_fraction=0.25,
    num_experts=16,
    top_k=4,
    moe_intermediate_size=8,
    shared_expert_intermediate_size=16,
)
HYBRID_FAMILY_TEST_OVERRIDES: dict[str, dict[str, Any]] = {"qwen3_next": _HYBRID, "qwen3_5_moe_text": _HYBRID}


# YaRN at the tiny scale: a 16-token original context stretched 4x; with base 10^4 and betas 8 / 0.25 the ramp
# keeps a head's first frequency, interpolates its last ones and mixes one between; the cos/sin factor
# m(2) / m(1) and MLA's softmax factor m(1)^2 differ from 1. MLA gets 4 RoPE dims (2 frequencies).
YARN_TEST_OVERRIDES: dict[str, Any] = dict(
    rope_theta=10000.0,
    rope_yarn_factor=4.0,
    rope_yarn_original_max_position_embeddings=16,
    rope_yarn_beta_fast=8.0,
    rope_yarn_beta_slow=0.25,
    rope_yarn_mscale=2.0,
    rope_yarn_mscale_all_dim=1.0,
)
_MLA_YARN_WIDTHS = dict(qk_nope_head_dim=4, qk_rope_head_dim=4)


def tiny_yarn_config(family: str, **overrides) -> MoEModelConfig:
    """``tiny_family_config`` with YaRN RoPE scaling (``YARN_TEST_OVERRIDES``)."""
    widths = _MLA_YARN_WIDTHS if FAMILY_TEST_OVERRIDES[family].get("attention") == "mla" else {}
    return tiny_family_config(family, **{**YARN_TEST_OVERRIDES, **widths, **overrides})


def tiny_family_config(family: str, **overrides) -> MoEModelConfig:
    """``tiny_test_config`` as a model of ``family``."""
    family_overrides = FAMILY_TEST_OVERRIDES.get(family, HYBRID_FAMILY_TEST_OVERRIDES.get(family))
    if family_overrides is None:
        raise KeyError(f"no tiny test model for family {family!r}")
    return tiny_test_config(family=family, **{**family_overrides, **overrides})


def medium_test_config() -> MoEModelConfig:
    """The medium shape (``tools/bench_plan_memory.py``): 4 MoE layers, hidden 256, 16 experts top-4,
    vocabulary 8192; 43 MiB of fp32 weights, the largest tensors (embedding, head) 8 MiB each."""
    return MoEModelConfig(
        vocab_size=8192,
        hidden_size=256,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=2,
        head_dim=32,
        num_experts=16,
        top_k=4,
        moe_intermediate_size=128,
        max_position_embeddings=512,
    )


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


def policy_inputs(log_probs: torch.Tensor, seed: int = 5, noise: float = 1e-4) -> dict:
    """Old log-probs near ``log_probs`` (ratios well inside GSPO's clip range), advantages, a
    response mask with a different length per row."""
    generator = torch.Generator().manual_seed(seed)
    batch, seq = log_probs.shape
    mask = torch.zeros(batch, seq)
    for row in range(batch):
        mask[row, 3 + row : seq - row % 2] = 1.0
    old = log_probs + noise * (2 * torch.rand(batch, seq, generator=generator) - 1)
    return {"old_log_probs": old, "advantages": torch.randn(batch, generator=generator), "response_mask": mask}


def model_layout_worker(
    ctx,
    cfg: MoEModelConfig,
    state: dict,
    layout_kwargs: dict,
    policy: dict | None = None,
    build_kwargs: dict | None = None,
    dtype: str = "float32",
):
    """Build the layout, load ``state``, run forward+backward of a loss through megatron's schedule.

    The loss is a weighted log-likelihood, or -- with ``policy`` = {"loss": name, "old_log_probs",
    "advantages", "response_mask"} -- the trainer's own policy-loss head with global denominators
    (optionally with "entropy_coef", "kl_coef", "kl_estimator" and per-row "ref_log_probs", and
    "algorithm": any other ``algorithm.loss`` settings (``LossConfig`` fields), e.g. a preset's clip).
    ``build_kwargs`` go to ``build_model`` (e.g. ``token_dispatcher``, ``expert_mlp``).
    Returns this rank's exported weights, the log-probs it holds (last stage, by dp rank), its loss
    contribution, the gradients gathered to HF names and the decoder layers it built ("layers").
    ``dtype="bfloat16"`` builds bf16 weights (gradients reduced in fp32, as the trainer does).
    """
    variant = {"params_dtype": getattr(torch, dtype), **(build_kwargs or {})}
    (result,) = model_variants_worker(ctx, cfg, state, layout_kwargs, [variant], policy)
    return result


def assert_same_results(reference: dict, candidate: dict, rank: int, tol: float) -> None:
    """Two ``model_layout_worker`` results of one rank agree: log-probs to ``tol`` (relative and
    absolute), the loss to relative ``tol``, every gathered gradient to rtol 1e-5 / atol 1e-7."""
    assert candidate["log_probs"].keys() == reference["log_probs"].keys()
    for dp_rank, logp in reference["log_probs"].items():
        torch.testing.assert_close(candidate["log_probs"][dp_rank], logp, rtol=tol, atol=tol)
    torch.testing.assert_close(candidate["loss"], reference["loss"], rtol=tol, atol=1e-8)
    for key, grad in reference["grads"].items():
        torch.testing.assert_close(candidate["grads"][key], grad, rtol=1e-5, atol=1e-7, msg=_naming(rank, key))


def _naming(rank: int, key: str) -> Callable[[str], str]:
    return lambda message: f"rank {rank} {key}: {message}"


def model_variants_worker(
    ctx, cfg: MoEModelConfig, state: dict, layout_kwargs: dict, variants: list[dict], policy: dict | None = None
) -> list[dict]:
    """``model_layout_worker`` once per entry of ``variants`` (``build_model`` keyword arguments),
    in one launch and one parallel state: a list of its results in the same order."""
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    try:
        return [_forward_backward(cfg, state, layout, mesh, policy, build_kwargs) for build_kwargs in variants]
    finally:
        mesh.destroy()


def _forward_backward(cfg: MoEModelConfig, state: dict, layout, mesh, policy: dict | None, build_kwargs: dict) -> dict:
    from megatron.core import tensor_parallel

    from gspo_megatron.policy.models.builder import build_model_chunks
    from gspo_megatron.policy.models.chunks import ModelChunks
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.parallel.context_parallel import gather_sequence

    chunks = build_model_chunks(cfg, layout, **build_kwargs)
    load_hf_weights(chunks, cfg, state, mesh)
    exported = export_hf_state_dict(chunks, cfg, mesh)
    ddp = ModelChunks(wrap_for_training(chunk, chunk.config) for chunk in chunks)
    ddp.zero_grad_buffer()

    inputs, targets, weights = fixed_batch(cfg)
    total_tokens = weights.numel()
    rows = inputs.shape[0] // layout.dp
    sl = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    per_micro = max(1, rows // 2)
    per_row = {"weights": weights}
    if policy is not None:
        per_row.update(
            {k: policy[k] for k in ("old_log_probs", "advantages", "response_mask", "ref_log_probs") if k in policy}
        )
    micro_batches = [
        MicroBatch(
            tokens=inputs[sl][i : i + per_micro],
            targets=targets[sl][i : i + per_micro],
            **{k: v[sl][i : i + per_micro] for k, v in per_row.items()},
        )
        for i in range(0, rows, per_micro)
    ]
    budget = (policy or {}).get("micro_batch_tokens")
    if budget is not None and policy is not None:
        micro_batches = _token_budget_micro_batches(
            inputs, targets, per_row, policy["response_mask"], budget, layout, mesh.dp_rank
        )

    cp_group = mesh.row_parts_group

    def loss_callback(logits, batch):
        # logits [b, s / cp, V/tp]; megatron's vocab-parallel CE gives -log p(target) per token.
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.targets)
        loss = -(batch.weights * logp).sum() / total_tokens  # this CP rank's tokens' share
        return loss, {"log_probs": gather_sequence(logp.detach(), cp_group), "loss": loss.detach()}

    if policy is not None:
        loss_callback = _policy_callback(policy, mesh)

    metrics = run_schedule(ddp, micro_batches, loss_callback, forward_only=False)
    grads = export_hf_state_dict(chunks, cfg, mesh, tensor_of=gradient_of)
    log_probs = {}
    loss = torch.tensor(0.0)
    if metrics and budget is not None:  # rows in plan order, each micro-batch cut to its own width
        full = torch.zeros(inputs.shape)
        for mb, m in zip(micro_batches, metrics, strict=True):
            full[mb.rows, : m["log_probs"].shape[1]] = m["log_probs"]
        log_probs[mesh.dp_rank] = full
    elif metrics:
        log_probs[mesh.dp_rank] = torch.cat([m["log_probs"] for m in metrics], dim=0)
    if metrics:
        loss = sum(m["loss"] for m in metrics)
    layers = [layer.layer_number - 1 for chunk in chunks for layer in chunk.decoder.layers]  # global, 0-based
    return {"exported": exported, "log_probs": log_probs, "grads": grads, "loss": loss, "layers": layers}


def _token_budget_micro_batches(inputs, targets, per_row: dict, mask, budget: int, layout, dp_rank: int):
    """The trainer's token-budget plan over the fixed batch: a row's length ends at its last
    response target (+1 for the shifted input, +1 for the target)."""
    from gspo_megatron.contracts.token_budget import token_budget_plan
    from gspo_megatron.policy.parallel.layout import sequence_multiple

    positions = torch.arange(mask.shape[1]).expand_as(mask)
    lengths = torch.where(mask > 0, positions, torch.zeros_like(positions)).max(dim=1).values + 2
    plans = token_budget_plan(
        lengths,
        first_row=0,
        dp_size=layout.dp,
        budget=budget,
        multiple=sequence_multiple(layout),
        max_width=inputs.shape[1] + 1,
    )
    out = []
    for plan in plans:
        rows, fed = plan.rows[dp_rank], plan.width - 1
        cut = {k: v[rows, :fed] if v.dim() > 1 else v[rows] for k, v in per_row.items()}
        out.append(MicroBatch(tokens=inputs[rows, :fed], targets=targets[rows, :fed], rows=rows, **cut))
    return out


def _policy_callback(policy: dict, mesh):
    from gspo_megatron.algorithms.config import AlgorithmConfig, KLConfig
    from gspo_megatron.algorithms.losses import LossConfig
    from gspo_megatron.policy.loss_heads import PolicyLossHead
    from gspo_megatron.policy.parallel.context_parallel import gather_sequence

    clip = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.28)}[policy["loss"]]
    mask = policy["response_mask"]
    settings = {"clip_low": clip[0], "clip_high": clip[1], "entropy_coef": policy.get("entropy_coef", 0.0)}
    settings.update(policy.get("algorithm", {}))
    kl = KLConfig(coef=policy.get("kl_coef", 0.0), estimator=policy.get("kl_estimator", "k3"))
    cp_group = mesh.row_parts_group
    head = PolicyLossHead(
        AlgorithmConfig(name=policy["loss"], loss=LossConfig(name=policy["loss"], **settings), kl=kl),
        mesh.tp_group,
        cp_group,
        1.0,
        global_num_sequences=(mask.sum(1) > 0).sum().float(),
        global_num_tokens=mask.sum(),
    )

    def callback(logits, batch):
        loss, metrics = head(logits, batch)
        from gspo_megatron.algorithms.logprobs import vocab_parallel_log_probs

        with torch.no_grad():
            logp, _ = vocab_parallel_log_probs(logits, batch.targets, tp_group=mesh.tp_group)
        return loss, {"log_probs": gather_sequence(logp, cp_group), "loss": loss.detach()}

    return callback


def tiny_qwen3_moe_hf_config():
    """The rollout tests' transformers Qwen3-MoE: 2 layers, 4 experts top-2, vocabulary 64."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim is a kwarg transformers reads, not in its stub
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )


def tiny_qwen3_moe_hf_weights(seed: int) -> dict[str, torch.Tensor]:
    """transformers' own initialisation of ``tiny_qwen3_moe_hf_config`` under ``seed``."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return dict(Qwen3MoeForCausalLM(tiny_qwen3_moe_hf_config()).state_dict())
