"""Every Hugging Face checkpoint tensor of a model, under its family's checkpoint names
(``model_families.py``), with its full shape (torch-free, so the planner can size a weight sync
without importing torch)."""

from __future__ import annotations

from gspo_megatron.models.config import MoEModelConfig


def hf_shapes(cfg: MoEModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the model with its full shape, by unit (embedding, layers, head)."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_layers):
        shapes.update(_layer_shapes(cfg, layer))
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _layer_shapes(cfg: MoEModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    h, hd, family = cfg.hidden_size, cfg.head_dim, cfg.architecture
    p = f"model.layers.{layer}."
    out = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, h),
        p + "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, h),
        p + "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, h),
        p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
    }
    if cfg.qkv_bias:
        for which, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
            out[p + f"self_attn.{which}_proj.bias"] = (heads * hd,)
    if cfg.qk_norm:
        out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    out[p + "post_attention_layernorm.weight"] = (h,)
    if layer in set(cfg.dense_layers) or not cfg.is_moe:
        f = cfg.dense_intermediate_size
        out.update(
            {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
        )
        return out
    out[family.router_name(layer)] = (cfg.num_experts, h)
    if cfg.expert_bias:
        out[family.expert_bias_name(layer)] = (cfg.num_experts,)
    i = cfg.moe_intermediate_size
    for e in range(cfg.num_experts):
        out.update(
            {
                family.expert_name(layer, e, "gate"): (i, h),
                family.expert_name(layer, e, "up"): (i, h),
                family.expert_name(layer, e, "down"): (h, i),
            }
        )
    if cfg.shared_expert_intermediate_size and family.shared_expert is not None:
        s = cfg.shared_expert_intermediate_size
        names = family.shared_expert_names(layer)
        out.update({names["gate"]: (s, h), names["up"]: (s, h), names["down"]: (h, s)})
        if "gate_weight" in names:
            out[names["gate_weight"]] = (1, h)
    return out
