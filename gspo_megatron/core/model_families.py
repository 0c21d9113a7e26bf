"""Model families as data: what differs between the MoE architectures the trainer builds, converts
and serves, one registered ``ModelFamily`` each (``FAMILIES``, keyed by HF ``model_type``).

The model config (``policy/models/config.py``) says what the model is -- q/k norms, q/k/v biases, the router's
score function, expert bias, groups and scaling, the rotary fraction, dense layers, a shared expert --
and the family says how its HF architecture writes that down and what it can represent: its
config.json keys (``hf_fields`` writes them, ``read_hf_fields`` reads them back into model-config
terms), its transformers classes, its checkpoint names (router, expert bias, the experts' three
projections, the shared expert), the settings its architecture fixes (``fixed``: a model config with
another value cannot be served or exported, and is refused naming the key), where dense layers may be,
and whether a shared expert is sigmoid-gated. Attention, RMSNorm, RoPE, SwiGLU experts and the QKV and
gate/up fusions are common, so the builder (``policy/models/builder.py``), the conversion
(``policy/models/conversion.py``, ``policy/models/hf_shapes.py``) and the embedded engine
(``rollout/embedded/engine.py``, ``rollout/embedded/weights.py``) read the differences from here and the
model config, and name no family.

Families:
- ``qwen3_moe`` (Qwen3-MoE): per-head q/k RMSNorm; softmax over all experts, top-k, renormalised over
  the k when ``norm_topk_prob``; dense layers anywhere (``mlp_only_layers``); checkpoint names
  ``mlp.gate`` and ``mlp.experts.{e}.{gate,up,down}_proj``.
- ``qwen2_moe`` (Qwen2-MoE): no q/k norm, q/k/v biases; softmax top-k, by default NOT renormalised
  (``norm_topk_prob=false``: megatron's softmax over all experts before the top-k); a shared expert
  beside the routed ones, its output scaled by ``sigmoid(shared_expert_gate(x))`` (megatron's
  ``moe_shared_expert_gate``); dense layers as Qwen3-MoE's; checkpoint names as Qwen3-MoE's plus
  ``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate``.
- ``mixtral`` (Mixtral): no q/k norm; softmax top-k always renormalised (transformers'
  ``MixtralTopKRouter``); every layer MoE, no shared expert; ``intermediate_size`` is the expert's FFN
  size; checkpoint names ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w3/w2``
  (gate, up, down).
- ``olmoe`` (OLMoE): q/k RMSNorm over all heads' width at once (``q_norm`` over num_heads x head_dim =
  hidden_size, ``k_norm`` over num_kv_heads x head_dim), before the split into heads; softmax top-k, by
  default not renormalised; every layer MoE, no shared expert; ``intermediate_size`` is the expert's FFN
  size; checkpoint names as Qwen3-MoE's.
- ``glm4_moe`` (GLM-4.5, -Air): the DeepSeek-V3 router -- sigmoid scores; the expert bias
  (``e_score_correction_bias``, a buffer, not trained by gradients) is added to pick the experts only,
  the unbiased scores of the picked ones weight them, renormalised and times
  ``routed_scaling_factor``; group-limited top-k (``n_group`` groups scored by their top-2 experts,
  ``topk_group`` kept). Un-gated shared experts (``n_shared_experts`` x the expert size); the first
  ``first_k_dense_replace`` layers dense; optional q/k norms and q/k/v biases; RoPE on a fraction of
  each head (``partial_rotary_factor``). Checkpoint names ``mlp.gate``, ``mlp.gate.e_score_correction_bias``,
  ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.{gate,up,down}_proj``. GLM-4.5's
  multi-token-prediction layer (``num_nextn_predict_layers``) is not built (RL trains the next token).
- ``deepseek_v3`` (DeepSeek-V3, R1, Kimi-K2): GLM's MoE (the same router, shared experts, dense first
  layers and checkpoint names) with multi-latent attention: ``q_a_proj`` -> ``q_a_layernorm`` ->
  ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa`` (the kv latent and one RoPE key) ->
  ``kv_a_layernorm`` -> ``kv_b_proj`` (per head: key without RoPE, value), interleaved RoPE
  (megatron's MLA de-interleaves the same way). YaRN RoPE scaling (the real checkpoints' 128K context)
  is the model config's, common to the families (``policy/models/config.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

DEFAULT_FAMILY = "qwen3_moe"  # model.family when a config names none (and the embedded engine's config)
PROJECTIONS = ("gate", "up", "down")  # an expert's SwiGLU: down(silu(gate(x)) * up(x))


class LinearAttentionInputs(str, Enum):
    """How a family's checkpoint writes gated DeltaNet's input projections (see the module docstring)."""

    qkvz_ba = "qkvz_ba"  # Qwen3-Next: in_proj_qkvz and in_proj_ba, each grouped by key head
    qkv_z_b_a = "qkv_z_b_a"  # Qwen3.5: in_proj_qkv ([q, k, v] flat), in_proj_z, in_proj_b, in_proj_a


LINEAR_ATTENTION_INPUT_NAMES = {
    LinearAttentionInputs.qkvz_ba: ("in_proj_qkvz", "in_proj_ba"),
    LinearAttentionInputs.qkv_z_b_a: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
}


class DenseLayers(str, Enum):
    anywhere = "anywhere"  # any layer may be dense (Qwen: mlp_only_layers, decoder_sparse_step)
    first = "first"  # only the first k (GLM, DeepSeek: first_k_dense_replace)
    none = "none"  # every layer MoE (Mixtral)


@dataclass(frozen=True)
class ModelFamily:
    model_type: str  # HF config.json ``model_type``, the registry key and ``model.family``
    title: str  # for messages and the README
    architecture: str  # transformers' causal-LM class (config.json ``architectures``)
    config_class: str  # transformers' config class
    dense_layers: DenseLayers
    hf_fields: Callable[[Any], dict[str, Any]]  # model config -> the family's own config.json keys
    read_hf_fields: Callable[[Mapping[str, Any], int], dict[str, Any]]  # config.json, layers -> config kwargs
    fixed: Mapping[str, Any] = field(default_factory=dict)  # model-config fields the architecture fixes
    moe_module: str = "mlp"  # checkpoint name of a layer's MoE block: ``model.layers.{l}.{moe_module}``
    # checkpoint names of the experts' gate, up and down projections
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: str | None = None  # checkpoint module of the shared expert (None: the architecture has none)
    shared_expert_gated: bool = False  # its output is scaled by sigmoid(shared_expert_gate(x))
    # q/k RMSNorm over each head's head_dim (Qwen3); False: over all heads' width at once, before the split
    # into heads (OLMoE: q_norm over num_heads x head_dim, k_norm over num_kv_heads x head_dim)
    qk_norm_per_head: bool = True
    # gated DeltaNet layers (None: the architecture has none) and how its checkpoint writes their input projections
    linear_attention_inputs: LinearAttentionInputs | None = None
    zero_centered_norms: bool = False  # RMSNorm weights stored as w with the scale 1 + w (Qwen3-Next, Qwen3.5)

    def linear_attention_names(self, layer: int) -> dict[str, str]:
        """Checkpoint names of one gated DeltaNet layer: its input projections (by their own names), "conv1d",
        "A_log", "dt_bias", "norm" (the gated RMSNorm) and "out_proj"."""
        if self.linear_attention_inputs is None:
            raise ValueError(f"the {self.title} architecture has no linear-attention layers")
        p = f"model.layers.{layer}.linear_attn."
        names = {name: f"{p}{name}.weight" for name in LINEAR_ATTENTION_INPUT_NAMES[self.linear_attention_inputs]}
        names |= {which: f"{p}{which}.weight" for which in ("conv1d", "norm", "out_proj")}
        return names | {"A_log": p + "A_log", "dt_bias": p + "dt_bias"}

    def router_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}.gate.weight"

    def expert_bias_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}.gate.e_score_correction_bias"

    def expert_name(self, layer: int, expert: int, projection: str) -> str:
        """Checkpoint name of one expert's ``projection`` ("gate", "up" or "down")."""
        which = self.expert_projections[PROJECTIONS.index(projection)]
        return f"model.layers.{layer}.{self.moe_module}.experts.{expert}.{which}.weight"

    def shared_expert_names(self, layer: int) -> dict[str, str]:
        """Checkpoint names of the shared expert's "gate", "up", "down" (and its sigmoid's "gate_weight")."""
        if self.shared_expert is None:
            raise ValueError(f"the {self.title} architecture has no shared expert")
        p = f"model.layers.{layer}.{self.moe_module}."
        names = {which: f"{p}{self.shared_expert}.{which}_proj.weight" for which in PROJECTIONS}
        if self.shared_expert_gated:
            names["gate_weight"] = f"{p}{self.shared_expert}_gate.weight"
        return names

    def expert_name_pattern(self) -> str:
        """A regex over checkpoint names with groups (layer, expert, checkpoint projection name)."""
        names = "|".join(self.expert_projections)
        return rf"^model\.layers\.(\d+)\.{self.moe_module}\.experts\.(\d+)\.({names})\.weight$"

    def projection_of(self, checkpoint_name: str) -> str:
        """ "gate", "up" or "down" for the checkpoint's projection name (``w1`` -> "gate" for Mixtral)."""
        return PROJECTIONS[self.expert_projections.index(checkpoint_name)]

    def transformers_classes(self) -> tuple[type, type]:
        """(config class, causal-LM class) from transformers."""
        import transformers

        return getattr(transformers, self.config_class), getattr(transformers, self.architecture)


# The settings the softmax-router families fix: the softmax router, no expert bias, no groups, no output gate.
_SOFTMAX_ROUTER_GQA = dict(
    attention="gqa",
    router_score="softmax",
    expert_bias=False,
    router_groups=1,
    router_group_topk=1,
    routed_scaling_factor=1.0,
    attention_output_gate=False,
)
_SOFTMAX_ROUTER = dict(_SOFTMAX_ROUTER_GQA, rotary_fraction=1.0)  # ... and full RoPE (all but the hybrids)


def _qwen3_moe_fields(cfg) -> dict[str, Any]:
    return {
        "intermediate_size": cfg.dense_intermediate_size or cfg.moe_intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(cfg.dense_layers),
    }


def _read_qwen3_moe(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    step = hf.get("decoder_sparse_step", 1) or 1
    mlp_only = set(hf.get("mlp_only_layers", []) or [])
    dense = [i for i in range(layers) if i in mlp_only or (i + 1) % step != 0]
    return {
        # transformers >= 5 writes num_local_experts (num_experts is its attribute alias)
        "num_experts": hf.get("num_experts", hf.get("num_local_experts", 0)) or 0,
        "moe_intermediate_size": hf.get("moe_intermediate_size", 0),
        "norm_topk_prob": hf.get("norm_topk_prob", True),
        "dense_layers": dense,
        "dense_intermediate_size": hf.get("intermediate_size", 0) if dense else 0,
        "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0) or 0,
        # read, not assumed: a config with attention biases is refused by name (``fixed``), never loaded without them
        "qkv_bias": bool(hf.get("attention_bias", False)),
    }


def _qwen2_moe_fields(cfg) -> dict[str, Any]:
    return _qwen3_moe_fields(cfg) | {
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "qkv_bias": True,
        "use_sliding_window": False,
    }


def _read_qwen2_moe(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    if hf.get("use_sliding_window"):
        raise ValueError("config.json has use_sliding_window=true: sliding-window attention is not built here")
    return _read_qwen3_moe(hf, layers) | {"qkv_bias": hf.get("qkv_bias", True), "qk_norm": False}


def _mixtral_fields(cfg) -> dict[str, Any]:
    return {
        "intermediate_size": cfg.moe_intermediate_size,
        "num_local_experts": cfg.num_experts,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
    }


def _read_mixtral(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    if hf.get("sliding_window"):
        raise ValueError(
            f"config.json has sliding_window={hf['sliding_window']}: sliding-window attention is not built "
            "here (Mixtral-8x7B/8x22B have none); set it to null"
        )
    return {
        "num_experts": hf.get("num_local_experts", hf.get("num_experts", 0)) or 0,
        "moe_intermediate_size": hf.get("intermediate_size", 0),
        "norm_topk_prob": True,
        "qk_norm": False,
    }


def _olmoe_fields(cfg) -> dict[str, Any]:
    return {
        "intermediate_size": cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts,
        "norm_topk_prob": cfg.norm_topk_prob,
        "clip_qkv": None,
    }


def _read_olmoe(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    if hf.get("clip_qkv") is not None:
        raise ValueError(
            f"config.json has clip_qkv={hf['clip_qkv']}: clamped q/k/v are not built here (OLMoE-1B-7B has none)"
        )
    return {
        "num_experts": hf.get("num_experts", hf.get("num_local_experts", 0)) or 0,
        "moe_intermediate_size": hf.get("intermediate_size", 0),
        "norm_topk_prob": hf.get("norm_topk_prob", False),
        "qkv_bias": bool(hf.get("attention_bias", False)),
    }


def _sigmoid_moe_fields(cfg) -> dict[str, Any]:
    """The MoE keys GLM-4.5 and DeepSeek-V3 write alike (router, shared experts, first-k dense)."""
    if cfg.shared_expert_intermediate_size % max(cfg.moe_intermediate_size, 1):
        raise ValueError(
            f"model.shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} must be a multiple of "
            f"model.moe_intermediate_size={cfg.moe_intermediate_size} (GLM's n_shared_experts experts)"
        )
    return {
        "intermediate_size": cfg.dense_intermediate_size or cfg.moe_intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.num_experts,
        "n_shared_experts": cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
        "first_k_dense_replace": len(cfg.dense_layers),
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.router_groups,
        "topk_group": cfg.router_group_topk,
    }


def _read_sigmoid_moe(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    first_dense = hf.get("first_k_dense_replace", 1)
    expert_size = hf.get("moe_intermediate_size", 0)
    return {
        "num_experts": hf.get("n_routed_experts", hf.get("num_local_experts", 0)) or 0,
        "moe_intermediate_size": expert_size,
        "norm_topk_prob": hf.get("norm_topk_prob", True),
        "dense_layers": list(range(min(first_dense, layers))),
        "dense_intermediate_size": hf.get("intermediate_size", 0) if first_dense else 0,
        "shared_expert_intermediate_size": (hf.get("n_shared_experts", 1) or 0) * expert_size,
        "router_score": "sigmoid",
        "expert_bias": True,
        "router_groups": hf.get("n_group", 1) or 1,
        "router_group_topk": hf.get("topk_group", 1) or 1,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
    }


def _glm4_moe_fields(cfg) -> dict[str, Any]:
    return _sigmoid_moe_fields(cfg) | {
        "use_qk_norm": cfg.qk_norm,
        "attention_bias": cfg.qkv_bias,
        "partial_rotary_factor": cfg.rotary_fraction,
        "num_nextn_predict_layers": 0,
    }


def _read_glm4_moe(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or {}
    return _read_sigmoid_moe(hf, layers) | {
        "qk_norm": hf.get("use_qk_norm", False),
        "qkv_bias": hf.get("attention_bias", False),
        "rotary_fraction": float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))),
    }


def _deepseek_v3_fields(cfg) -> dict[str, Any]:
    return _sigmoid_moe_fields(cfg) | {
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_rope_head_dim,  # HF's meaning: the RoPE part (the rotary embedding's width)
        "num_key_value_heads": cfg.num_attention_heads,
        "rope_interleave": True,
        # the published config.json's router keys, which SGLang's DeepSeek model reads (transformers' class
        # has no place for them): every layer past the dense ones MoE, sigmoid scores, bias-corrected top-k
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
    }


def _read_deepseek_v3(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    if hf.get("rope_interleave", True) is False:
        raise ValueError("config.json has rope_interleave=false: DeepSeek-V3's RoPE is built interleaved here")
    nope, rope = hf.get("qk_nope_head_dim", 128), hf.get("qk_rope_head_dim", 64)
    fields = _read_sigmoid_moe(hf, layers) | {
        "attention": "mla",
        "qk_norm": True,
        "qkv_bias": False,
        "rotary_fraction": 1.0,
        "q_lora_rank": hf.get("q_lora_rank") or 0,
        "kv_lora_rank": hf.get("kv_lora_rank", 512),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": hf.get("v_head_dim", 128),
        "head_dim": nope + rope,
        "num_kv_heads": hf["num_attention_heads"],
    }
    return fields


def _hybrid_fields(cfg) -> dict[str, Any]:
    """The keys Qwen3-Next and Qwen3.5 write alike: the layer pattern, gated DeltaNet's shape, partial RoPE."""
    linear = set(cfg.linear_attention_layers)
    return {
        "layer_types": ["linear_attention" if i in linear else "full_attention" for i in range(cfg.num_layers)],
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "partial_rotary_factor": cfg.rotary_fraction,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }


def _read_hybrid(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    interval = hf.get("full_attention_interval", 4)  # transformers' pattern when layer_types is absent
    types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
    ]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise ValueError(
            f"config.json has layer_types={types}: expected {layers} entries of 'linear_attention' or 'full_attention'"
        )
    rope = hf.get("rope_parameters") or {}
    return {
        "linear_attention_layers": [i for i, kind in enumerate(types) if kind == "linear_attention"],
        "linear_num_key_heads": hf.get("linear_num_key_heads", 16),
        "linear_num_value_heads": hf.get("linear_num_value_heads", 32),
        "linear_key_head_dim": hf.get("linear_key_head_dim", 128),
        "linear_value_head_dim": hf.get("linear_value_head_dim", 128),
        "linear_conv_kernel_dim": hf.get("linear_conv_kernel_dim", 4),
        "rotary_fraction": float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))),
        "attention_output_gate": True,
        "qk_norm": True,
        "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0) or 0,
    }


def _qwen3_next_fields(cfg) -> dict[str, Any]:
    return _qwen3_moe_fields(cfg) | _hybrid_fields(cfg)


def _read_qwen3_next(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    return _read_qwen3_moe(hf, layers) | _read_hybrid(hf, layers)


def _qwen3_5_moe_fields(cfg) -> dict[str, Any]:
    return {"moe_intermediate_size": cfg.moe_intermediate_size, "num_experts": cfg.num_experts} | _hybrid_fields(cfg)


def _read_qwen3_5_moe(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    return {
        "num_experts": hf.get("num_experts", 0) or 0,
        "moe_intermediate_size": hf.get("moe_intermediate_size", 0),
        "qkv_bias": bool(hf.get("attention_bias", False)),
    } | _read_hybrid(hf, layers)


# what the two hybrid families fix: Qwen's softmax router, per-head q/k norms, gated full attention
_HYBRID = dict(_SOFTMAX_ROUTER_GQA, qk_norm=True, qkv_bias=False, attention_output_gate=True)

FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily(
            model_type="qwen3_moe",
            title="Qwen3-MoE",
            architecture="Qwen3MoeForCausalLM",
            config_class="Qwen3MoeConfig",
            dense_layers=DenseLayers.anywhere,
            hf_fields=_qwen3_moe_fields,
            read_hf_fields=_read_qwen3_moe,
            fixed=dict(_SOFTMAX_ROUTER, qk_norm=True, qkv_bias=False),
        ),
        ModelFamily(
            model_type="qwen2_moe",
            title="Qwen2-MoE",
            architecture="Qwen2MoeForCausalLM",
            config_class="Qwen2MoeConfig",
            dense_layers=DenseLayers.anywhere,
            shared_expert="shared_expert",
            shared_expert_gated=True,
            hf_fields=_qwen2_moe_fields,
            read_hf_fields=_read_qwen2_moe,
            fixed=dict(_SOFTMAX_ROUTER, qk_norm=False, qkv_bias=True),
        ),
        ModelFamily(
            model_type="mixtral",
            title="Mixtral",
            architecture="MixtralForCausalLM",
            config_class="MixtralConfig",
            moe_module="block_sparse_moe",
            expert_projections=("w1", "w3", "w2"),
            dense_layers=DenseLayers.none,
            hf_fields=_mixtral_fields,
            read_hf_fields=_read_mixtral,
            # transformers' MixtralTopKRouter renormalises the k scores whatever the config says
            fixed=dict(_SOFTMAX_ROUTER, qk_norm=False, qkv_bias=False, norm_topk_prob=True),
        ),
        ModelFamily(
            model_type="olmoe",
            title="OLMoE",
            architecture="OlmoeForCausalLM",
            config_class="OlmoeConfig",
            dense_layers=DenseLayers.none,
            hf_fields=_olmoe_fields,
            read_hf_fields=_read_olmoe,
            qk_norm_per_head=False,
            fixed=dict(_SOFTMAX_ROUTER, qk_norm=True, qkv_bias=False),
        ),
        ModelFamily(
            model_type="glm4_moe",
            title="GLM-4.5 (Glm4Moe)",
            architecture="Glm4MoeForCausalLM",
            config_class="Glm4MoeConfig",
            dense_layers=DenseLayers.first,
            shared_expert="shared_experts",
            hf_fields=_glm4_moe_fields,
            read_hf_fields=_read_glm4_moe,
            # megatron renormalises a sigmoid router's top-k always (moe_utils.topk_routing_with_score_function)
            fixed=dict(
                attention="gqa",
                router_score="sigmoid",
                expert_bias=True,
                norm_topk_prob=True,
                attention_output_gate=False,
            ),
        ),
        ModelFamily(
            model_type="qwen3_next",
            title="Qwen3-Next",
            architecture="Qwen3NextForCausalLM",
            config_class="Qwen3NextConfig",
            dense_layers=DenseLayers.anywhere,
            shared_expert="shared_expert",
            shared_expert_gated=True,
            linear_attention_inputs=LinearAttentionInputs.qkvz_ba,
            zero_centered_norms=True,
            hf_fields=_qwen3_next_fields,
            read_hf_fields=_read_qwen3_next,
            fixed=_HYBRID,
        ),
        ModelFamily(
            model_type="qwen3_5_moe_text",
            title="Qwen3.5-MoE (language model)",
            architecture="Qwen3_5MoeForCausalLM",
            config_class="Qwen3_5MoeTextConfig",
            dense_layers=DenseLayers.none,
            shared_expert="shared_expert",
            shared_expert_gated=True,
            linear_attention_inputs=LinearAttentionInputs.qkv_z_b_a,
            zero_centered_norms=True,
            hf_fields=_qwen3_5_moe_fields,
            read_hf_fields=_read_qwen3_5_moe,
            # transformers' Qwen3_5MoeTopKRouter renormalises the k scores always
            fixed=dict(_HYBRID, norm_topk_prob=True),
        ),
        ModelFamily(
            model_type="deepseek_v3",
            title="DeepSeek-V3 (also Kimi-K2)",
            architecture="DeepseekV3ForCausalLM",
            config_class="DeepseekV3Config",
            dense_layers=DenseLayers.first,
            shared_expert="shared_experts",
            hf_fields=_deepseek_v3_fields,
            read_hf_fields=_read_deepseek_v3,
            fixed=dict(
                attention="mla",
                qk_norm=True,
                qkv_bias=False,
                rotary_fraction=1.0,
                router_score="sigmoid",
                expert_bias=True,
                norm_topk_prob=True,
                attention_output_gate=False,
            ),
        ),
    )
}


# config.json model_types that are a registered family's architecture under another name
ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2: DeepSeek-V3's architecture (its config names DeepseekV3ForCausalLM)


# model_types looked at and not built, with why (checked against transformers 5.24's modeling code)
NOT_BUILT = {
    "gpt_oss": (
        "GPT-OSS is not built: its attention adds a learned per-head sink logit to each softmax "
        "(modeling_gpt_oss.py: eager_attention_forward's `sinks`) and alternates 128-token sliding-window layers "
        "with full ones, and its experts carry biases, interleave gate and up, and clamp their SwiGLU "
        "((up + 1) * gate * sigmoid(1.702 * gate), gate <= 7, |up| <= 7; GptOssExperts._apply_gate) behind a "
        "router with a bias; none of these is in the portable layers (policy/models/) yet"
    ),
}


def family(model_type: str) -> ModelFamily:
    """The registered family of ``model_type``; ``KeyError`` lists the registered ones (and says why one looked at
    is not built)."""
    if model_type not in FAMILIES:
        why = f" ({NOT_BUILT[model_type]})" if model_type in NOT_BUILT else ""
        raise KeyError(f"{model_type!r} is not a registered model family{why}; registered: {sorted(FAMILIES)}")
    return FAMILIES[model_type]
