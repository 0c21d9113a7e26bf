"""Every Hugging Face checkpoint tensor of a model, under its family's checkpoint names
(``core/model_families.py``), with its full shape (torch-free, so the planner can size a weight sync
without importing torch)."""

from __future__ import annotations

from gspo_megatron.policy.models.config import MoEModelConfig


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
    h, family = cfg.hidden_size, cfg.architecture
    p = f"model.layers.{layer}."
    if cfg.attention == "mla":
        out = {p + "input_layernorm.weight": (h,), **_mla_shapes(cfg, p + "self_attn.")}
    elif layer in set(cfg.linear_attention_layers):
        out = {p + "input_layernorm.weight": (h,), **linear_attention_shapes(cfg, layer)}
    else:
        out = _gqa_shapes(cfg, p)
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


def _gqa_shapes(cfg: MoEModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, hd = cfg.hidden_size, cfg.head_dim
    out = {
        p + "input_layernorm.weight": (h,),
        # with an output gate each head's query is followed by its gate (transformers' Qwen3-Next view)
        p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd * (2 if cfg.attention_output_gate else 1), h),
        p + "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, h),
        p + "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, h),
        p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
    }
    if cfg.qkv_bias:
        for which, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
            out[p + f"self_attn.{which}_proj.bias"] = (heads * hd,)
    if cfg.qk_norm:
        q_width, k_width = cfg.qk_norm_widths()
        out.update({p + "self_attn.q_norm.weight": (q_width,), p + "self_attn.k_norm.weight": (k_width,)})
    return out


def linear_attention_shapes(cfg: MoEModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """One gated DeltaNet layer's tensors under its family's names (``ModelFamily.linear_attention_names``)."""
    h, heads = cfg.hidden_size, cfg.linear_num_value_heads
    key_width, value_width = cfg.linear_num_key_heads * cfg.linear_key_head_dim, heads * cfg.linear_value_head_dim
    names = cfg.architecture.linear_attention_names(layer)
    input_rows = {
        "in_proj_qkvz": 2 * key_width + 2 * value_width,
        "in_proj_ba": 2 * heads,
        "in_proj_qkv": 2 * key_width + value_width,
        "in_proj_z": value_width,
        "in_proj_b": heads,
        "in_proj_a": heads,
    }
    out: dict[str, tuple[int, ...]] = {names[which]: (rows, h) for which, rows in input_rows.items() if which in names}
    out[names["conv1d"]] = (2 * key_width + value_width, 1, cfg.linear_conv_kernel_dim)
    out[names["A_log"]] = (heads,)
    out[names["dt_bias"]] = (heads,)
    out[names["norm"]] = (cfg.linear_value_head_dim,)
    out[names["out_proj"]] = (h, value_width)
    return out


def _mla_shapes(cfg: MoEModelConfig, a: str) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention (DeepSeek-V3): q from a latent (or directly), k/v from one latent plus a shared
    RoPE key; per head the query/key is [no-RoPE | RoPE] and kv_b_proj gives [key without RoPE | value]."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q_rows = heads * cfg.head_dim
    out: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank:
        out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, h)
        out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        out[a + "q_b_proj.weight"] = (q_rows, cfg.q_lora_rank)
    else:
        out[a + "q_proj.weight"] = (q_rows, h)
    out[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
    out[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    out[a + "kv_b_proj.weight"] = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    out[a + "o_proj.weight"] = (h, heads * cfg.v_head_dim)
    return out
