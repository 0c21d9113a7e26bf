"""Model configuration of the MoE families (``core/model_families.py``), its presets, and conversion to/from
HF configs.

Design decisions:
- One dataclass in Hugging Face terms (hidden size, experts, top-k, ...); the Megatron
  TransformerConfig is derived from it in ``policy/models/builder.py`` so there is one source of truth.
  ``family`` (an HF ``model_type``) picks what differs between architectures; the rest is common.
- ``dense_layers`` lists layers whose MLP is dense (HF ``mlp_only_layers``); every other layer is MoE.
- The router is softmax top-k: softmax over all experts, top-k, renormalised over the k chosen
  (``norm_topk_prob``), which equals megatron's top-k on logits followed by a softmax over the k.
- What a family's HF architecture cannot represent is refused by ``validate()`` (no engine could serve
  it, no HF checkpoint hold it): a shared expert (sigmoid-gated) where the architecture has none
  (Qwen3-MoE, Mixtral) or none where it has one (Qwen2-MoE), dense layers where every layer is MoE
  (Mixtral), a router setting the architecture ignores.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gspo_megatron.core.config_node import ConfigChoice, ConfigNode
from gspo_megatron.core.model_families import (
    ALIASES,
    DEFAULT_FAMILY,
    FAMILIES,
    NOT_BUILT,
    DenseLayers,
    ModelFamily,
)


class ModelConfigError(ValueError):
    """A model configuration that cannot be built; the message names the field."""


class LayerSpec(ConfigChoice):
    """``model.layer_spec``: which megatron layer implementation builds the model (policy/models/builder.py)."""

    auto = "auto"  # te where TransformerEngine and CUDA exist, else portable
    te = "te"  # TransformerEngine layers (GPU)
    portable = "portable"  # megatron's local layers with the project's attention (CPU and GPU)


class TokenDispatcher(ConfigChoice):
    """``model.token_dispatcher``: how megatron's MoE layer moves routed tokens to expert-parallel ranks
    (its ``moe_token_dispatcher_type``). Both give the same results; they differ in traffic."""

    alltoall = "alltoall"  # each routed token goes to the rank owning its expert (all-to-all-v over EP)
    allgather = "allgather"  # every rank gathers all tokens of the TP x EP group, keeps its experts' share


class AttentionKind(ConfigChoice):
    """``model.attention``: how queries, keys and values are made."""

    gqa = "gqa"  # grouped-query attention (Qwen, Mixtral, GLM)
    mla = "mla"  # multi-latent attention (DeepSeek-V3, Kimi-K2): low-rank latents, decoupled RoPE


class RouterScore(ConfigChoice):
    """``model.router_score``: the router's score function (megatron's ``moe_router_score_function``)."""

    softmax = "softmax"  # Qwen, Mixtral
    sigmoid = "sigmoid"  # DeepSeek-V3, GLM-4.5: with an expert bias; the top-k always renormalised


class ExpertMLP(ConfigChoice):
    """``model.expert_mlp``: how a rank runs its local experts (policy/models/builder.py)."""

    # one grouped GEMM over all local experts: TEGroupedMLP with TE, else policy/models/grouped_experts.py
    grouped = "grouped"
    sequential = "sequential"  # megatron's SequentialMLP: a Python loop, one GEMM per expert


@dataclass
class MoEModelConfig(ConfigNode):
    family: str = DEFAULT_FAMILY  # HF model_type of the architecture (core/model_families.py)
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4
    top_k: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    dense_layers: list[int] = field(default_factory=list)
    dense_intermediate_size: int = 0  # FFN size of dense layers (HF intermediate_size)
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.0
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # attention
    attention: AttentionKind = AttentionKind.gqa
    # multi-latent attention (attention=mla, DeepSeek-V3): queries from a q_lora_rank latent (0: projected
    # directly), keys and values from a kv_lora_rank latent, each head's query/key = qk_nope_head_dim dims
    # without RoPE + qk_rope_head_dim with it (one RoPE key shared by the heads), values v_head_dim;
    # head_dim is then qk_nope_head_dim + qk_rope_head_dim
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # YaRN RoPE scaling (HF ``rope_scaling`` of type "yarn": DeepSeek-V3 40, Kimi-K2 32, Qwen3's long-context
    # recipe 4); factor 1 is plain RoPE and the keys below are then unused. Frequency i of base^(-2i/d) is kept
    # (extrapolated) where it turns more than beta_fast times over the original context, divided by the factor
    # (interpolated) where less than beta_slow times, ramped between; cos and sin are multiplied by
    # m(mscale) / m(mscale_all_dim), m(x) = 0.1 x ln(factor) + 1 (m(1) alone when mscale_all_dim = 0), and
    # MLA's softmax scale by m(mscale_all_dim)^2 -- transformers' and megatron's formulas alike
    rope_yarn_factor: float = 1.0
    rope_yarn_original_max_position_embeddings: int = 4096  # the pre-training context the factor stretches
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 1.0
    rope_yarn_mscale_all_dim: float = 0.0
    qk_norm: bool = True  # per-head RMSNorm on queries and keys (Qwen3-MoE); MLA: RMSNorm on the latents
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2-MoE, GLM-4.5)
    rotary_fraction: float = 1.0  # share of each head's dims RoPE rotates (GLM-4.5: 0.5)
    # full attention's output scaled by sigmoid of a per-head gate its q projection also makes (Qwen3-Next, 3.5)
    attention_output_gate: bool = False
    # gated DeltaNet linear attention (core/model_families.py; megatron's ssm/gated_delta_net.py) in these layers
    # instead of full attention; its heads: key heads of linear_key_head_dim for q and k, value heads (a multiple)
    # of linear_value_head_dim, a causal depthwise conv of linear_conv_kernel_dim taps over q, k, v
    linear_attention_layers: list[int] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # the router (core/model_families.py): score function, expert bias, groups, scaling
    router_score: RouterScore = RouterScore.softmax
    expert_bias: bool = False  # sigmoid + a per-expert bias that picks, never weights (aux-loss-free balancing)
    # the bias's update per step from the experts' load (megatron's moe_router_bias_update_rate); 0 keeps the
    # checkpoint's bias, as DeepSeek-V3's last pre-training tokens did (its gamma: 0.001, then 0)
    expert_bias_update_rate: float = 0.0
    router_groups: int = 1  # group-limited top-k: experts in this many groups, scored by their top-2 ...
    router_group_topk: int = 1  # ... of which this many are kept per token
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (after renormalising)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and len(self.dense_layers) < self.num_layers

    @property
    def architecture(self) -> ModelFamily:
        """The registered family (``model.family``); validate() names the key when it is unknown."""
        return FAMILIES[self.family]

    def validate(self) -> None:
        if self.family not in FAMILIES:
            why = f" ({NOT_BUILT[self.family]})" if self.family in NOT_BUILT else ""
            raise ModelConfigError(
                f"model.family={self.family!r} is not a model family{why}; valid: {sorted(FAMILIES)}"
            )
        self._validate_family()
        self._validate_attention()
        self._validate_linear_attention()
        self._validate_rope_scaling()
        self._validate_router()
        positive = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim")
        for name in positive:
            if getattr(self, name) < 1:
                raise ModelConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"model.num_attention_heads = {self.num_attention_heads} must be a multiple of "
                f"model.num_kv_heads = {self.num_kv_heads} (grouped-query attention)"
            )
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ModelConfigError(f"model.dense_layers {bad} are outside 0..{self.num_layers - 1}")
        if self.dense_layers and self.dense_intermediate_size < 1:
            raise ModelConfigError("model.dense_layers is set but model.dense_intermediate_size is 0")
        if self.is_moe:
            if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
                raise ModelConfigError(f"model.top_k = {self.top_k} must be in 1..num_experts = {self.num_experts}")
            if self.moe_intermediate_size < 1:
                raise ModelConfigError("model.moe_intermediate_size must be >= 1 for an MoE model")

    def _validate_family(self) -> None:
        """What the family's HF architecture cannot represent: no engine could serve it, no checkpoint hold it."""
        family = self.architecture
        for name, value in family.fixed.items():
            if getattr(self, name) != value:
                shown = str(value).lower() if isinstance(value, bool) else value
                raise ModelConfigError(
                    f"model.{name}={getattr(self, name)!r}, but the {family.title} architecture has "
                    f"{name}={shown}; set model.{name}={shown}"
                )
        if self.shared_expert_intermediate_size and family.shared_expert is None:
            with_one = [f.model_type for f in FAMILIES.values() if f.shared_expert is not None]
            raise ModelConfigError(
                f"model.shared_expert_intermediate_size={self.shared_expert_intermediate_size}, but the "
                f"{family.title} architecture has no shared expert; set it to 0, or model.family to one with a "
                f"shared expert: {with_one}"
            )
        if self.is_moe and not self.shared_expert_intermediate_size and family.shared_expert is not None:
            raise ModelConfigError(
                f"the {family.title} architecture has a shared expert in every MoE layer; set "
                "model.shared_expert_intermediate_size (its FFN size)"
            )
        if self.dense_layers and family.dense_layers == DenseLayers.none:
            raise ModelConfigError(
                f"model.dense_layers={self.dense_layers}, but the {family.title} architecture makes every "
                "layer MoE; set model.dense_layers=[]"
            )
        first = list(range(len(self.dense_layers)))
        if family.dense_layers == DenseLayers.first and sorted(self.dense_layers) != first:
            raise ModelConfigError(
                f"model.dense_layers={self.dense_layers}, but the {family.title} architecture makes only the "
                f"first k layers dense; set model.dense_layers={first}"
            )

        width = self.num_attention_heads * self.head_dim
        if self.qk_norm and not family.qk_norm_per_head and width != self.hidden_size:
            raise ModelConfigError(
                f"model.head_dim={self.head_dim}: the {family.title} architecture's q norm is hidden_size "
                f"({self.hidden_size}) wide over num_attention_heads x head_dim ({width}); set "
                f"model.head_dim={self.hidden_size // self.num_attention_heads}"
            )
        try:
            family.hf_fields(self)  # what only the family's config.json keys can say (e.g. GLM's shared experts)
        except ValueError as error:
            raise ModelConfigError(str(error)) from error

    def _validate_attention(self) -> None:
        if not 0.0 < self.rotary_fraction <= 1.0 or int(self.head_dim * self.rotary_fraction) % 2:
            raise ModelConfigError(
                f"model.rotary_fraction={self.rotary_fraction} must be in (0, 1] and rotate an even number of "
                f"the head's {self.head_dim} dims"
            )
        if self.attention != AttentionKind.mla:
            return
        sizes = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        small = [name for name in sizes if getattr(self, name) < 1]
        if small or self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
            raise ModelConfigError(
                f"model.attention=mla needs model.{', model.'.join(sizes)} >= 1 (got {small} below), "
                "model.q_lora_rank >= 0 and an even model.qk_rope_head_dim"
            )
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ModelConfigError(
                f"model.attention=mla: model.head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                f"{self.qk_nope_head_dim + self.qk_rope_head_dim} (a query's and a key's width)"
            )
        if self.qkv_bias or not self.qk_norm or self.rotary_fraction != 1.0:
            raise ModelConfigError(
                "model.attention=mla has RMSNorm on its latents and no q/k/v biases, and RoPE rotates its "
                "qk_rope_head_dim dims: set model.qk_norm=true, model.qkv_bias=false, model.rotary_fraction=1.0"
            )

    def _validate_linear_attention(self) -> None:
        layers = self.linear_attention_layers
        if not layers:
            return
        family = self.architecture
        if family.linear_attention_inputs is None:
            with_it = [f.model_type for f in FAMILIES.values() if f.linear_attention_inputs is not None]
            raise ModelConfigError(
                f"model.linear_attention_layers={layers}, but the {family.title} architecture has no linear "
                f"attention; set model.linear_attention_layers=[], or model.family to one of {with_it}"
            )
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad or len(set(layers)) != len(layers):
            raise ModelConfigError(
                f"model.linear_attention_layers={layers}: layers must be distinct and in 0..{self.num_layers - 1}"
            )
        sizes = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        small = [name for name in (*sizes, "linear_conv_kernel_dim") if getattr(self, name) < 1]
        if small:
            raise ModelConfigError(f"model.linear_attention_layers is set: model.{', model.'.join(small)} must be >= 1")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError(
                f"model.linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                f"model.linear_num_key_heads={self.linear_num_key_heads} (each key head serves whole value heads)"
            )

    @property
    def rope_yarn(self) -> bool:
        """Whether RoPE is YaRN-scaled (``rope_yarn_factor`` > 1)."""
        return self.rope_yarn_factor != 1.0

    def _validate_rope_scaling(self) -> None:
        if not self.rope_yarn:
            return
        if self.rope_yarn_factor < 1.0:
            raise ModelConfigError(
                f"model.rope_yarn_factor={self.rope_yarn_factor} must be >= 1 "
                "(1: plain RoPE; YaRN stretches the context by the factor)"
            )
        if self.rotary_fraction != 1.0:
            raise ModelConfigError(
                f"model.rope_yarn_factor={self.rope_yarn_factor} with model.rotary_fraction={self.rotary_fraction}: "
                "megatron's YaRN rotates every dim of the head; set model.rotary_fraction=1.0 or "
                "model.rope_yarn_factor=1.0"
            )
        positive = ("rope_yarn_original_max_position_embeddings", "rope_yarn_beta_fast", "rope_yarn_beta_slow")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        mscale, all_dim = self.rope_yarn_mscale, self.rope_yarn_mscale_all_dim
        if all_dim < 0 or mscale <= 0 or (mscale != 1.0 and not all_dim):
            # transformers uses m(1) for cos/sin unless both are set (non-zero); megatron always m(mscale) / m(all_dim)
            raise ModelConfigError(
                f"model.rope_yarn_mscale={mscale}, model.rope_yarn_mscale_all_dim={all_dim}: the mscale counts only "
                "beside an mscale_all_dim > 0 (transformers ignores it otherwise); set model.rope_yarn_mscale=1.0, "
                "or model.rope_yarn_mscale_all_dim > 0"
            )

    def _validate_router(self) -> None:
        if self.expert_bias and self.router_score != RouterScore.sigmoid:
            raise ModelConfigError("model.expert_bias=true needs model.router_score=sigmoid (megatron's expert bias)")
        if self.router_score == RouterScore.sigmoid and not self.norm_topk_prob:
            raise ModelConfigError(
                "model.router_score=sigmoid renormalises the top-k scores always (megatron); "
                "set model.norm_topk_prob=true"
            )
        if self.expert_bias_update_rate < 0:
            raise ModelConfigError(f"model.expert_bias_update_rate={self.expert_bias_update_rate} must be >= 0")
        groups, keep = self.router_groups, self.router_group_topk
        if groups == 1 and keep == 1:
            return
        if not self.is_moe or self.num_experts % groups or not 1 <= keep <= groups:
            raise ModelConfigError(
                f"model.router_groups={groups} must divide model.num_experts={self.num_experts} and "
                f"model.router_group_topk={keep} be in 1..{groups}"
            )
        if self.top_k != 2 * keep:  # megatron scores a group by its top (top_k // group_topk), HF by its top 2
            raise ModelConfigError(
                f"group-limited routing scores each group by its top-2 experts (HF), which megatron does when "
                f"model.top_k = 2 x model.router_group_topk; got top_k={self.top_k}, router_group_topk={keep}"
            )

    def parameter_count(self) -> dict[str, int]:
        """Total and per-token active parameters, computed from the shape (nothing allocated)."""
        h, layers = self.hidden_size, self.num_layers
        attn = h * self.head_dim * (self.num_attention_heads * 2 + self.num_kv_heads * 2)
        attn += h * self.head_dim * self.num_attention_heads if self.attention_output_gate else 0
        attn += sum(self.qk_norm_widths()) if self.qk_norm else 0
        if self.attention == AttentionKind.mla:
            attn = self._mla_parameters()
        attn += (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        linear = len(self.linear_attention_layers)
        attn = (layers - linear) * attn + linear * self.linear_attention_parameters()
        norms = 2 * h
        expert = 3 * h * self.moe_intermediate_size
        gated = self.shared_expert_intermediate_size and self.architecture.shared_expert_gated
        shared = 3 * h * self.shared_expert_intermediate_size + (h if gated else 0)
        moe_total = self.num_experts * expert + self.num_experts * h + shared
        moe_active = self.top_k * expert + self.num_experts * h + shared
        dense = 3 * h * self.dense_intermediate_size
        n_dense = len(self.dense_layers)
        n_moe = layers - n_dense
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        total = embed + attn + layers * norms + n_moe * moe_total + n_dense * dense
        active = embed + attn + layers * norms + n_moe * moe_active + n_dense * dense
        return {"total": total, "active": active}

    @property
    def portable_spec_only(self) -> bool:
        """OLMoE's all-heads q/k norms and the hybrids' gated DeltaNet exist in the portable layer spec only:
        ``model.layer_spec=auto`` builds them with it on GPUs too (``builder.py``; the planner plans it)."""
        all_heads_qk_norm = self.qk_norm and not self.architecture.qk_norm_per_head
        return all_heads_qk_norm or bool(self.linear_attention_layers)

    def linear_attention_parameters(self) -> int:
        """One gated DeltaNet block: input projections (q, k, v, z, b, a), conv, A_log, dt_bias, norm, output."""
        h, key_width = self.hidden_size, self.linear_num_key_heads * self.linear_key_head_dim
        heads, value_width = self.linear_num_value_heads, self.linear_num_value_heads * self.linear_value_head_dim
        conv_channels = 2 * key_width + value_width
        inputs = h * (conv_channels + value_width + 2 * heads)
        return (
            inputs
            + conv_channels * self.linear_conv_kernel_dim
            + 2 * heads
            + self.linear_value_head_dim
            + value_width * h
        )

    def qk_norm_widths(self) -> tuple[int, int]:
        """The q and k RMSNorm weights' lengths: head_dim (per head), or all heads' (OLMoE)."""
        if self.architecture.qk_norm_per_head:
            return self.head_dim, self.head_dim
        return self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim

    def _mla_parameters(self) -> int:
        """One MLA block: q (down, norm, up or direct), kv down (+ the shared RoPE key), norm, up, output."""
        h, heads, q_width = self.hidden_size, self.num_attention_heads, self.head_dim
        q = h * heads * q_width
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * q_width
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h

    # --- Hugging Face interop ---------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The family's ``config.json`` dictionary for this model."""
        self.validate()  # the family's architecture can represent it
        family = self.architecture
        return {
            "architectures": [family.architecture],
            "model_type": family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_experts_per_tok": self.top_k,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": False,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            **self._hf_rope_scaling(),
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
            **family.hf_fields(self),  # last: a family's own meaning of a common key wins (GLM's attention_bias)
        }

    def _hf_rope_scaling(self) -> dict[str, Any]:
        """``rope_scaling`` of a YaRN-scaled model (transformers >= 5 stores it as ``rope_parameters``)."""
        if not self.rope_yarn:
            return {}
        return {
            "rope_scaling": {
                "type": "yarn",
                "rope_type": "yarn",
                "factor": self.rope_yarn_factor,
                "original_max_position_embeddings": self.rope_yarn_original_max_position_embeddings,
                "beta_fast": self.rope_yarn_beta_fast,
                "beta_slow": self.rope_yarn_beta_slow,
                "mscale": self.rope_yarn_mscale,
                "mscale_all_dim": self.rope_yarn_mscale_all_dim,
            }
        }

    def to_hf_config(self):
        config_class, _ = self.architecture.transformers_classes()
        return config_class(**self.to_hf_dict())

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> MoEModelConfig:
        model_type = hf.get("model_type")
        model_type = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
        if model_type not in FAMILIES:
            titles = ", ".join(f"{f.title} ({name})" for name, f in FAMILIES.items())
            why = f" ({NOT_BUILT[model_type]})" if model_type in NOT_BUILT else ""
            raise ModelConfigError(
                f"config.json has model_type={model_type!r}{why}; the model families built here are {titles} "
                "(docs/training.md, 'Model families')"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in hf]
        if missing:
            raise ModelConfigError(f"config.json lacks required fields {missing}")
        layers = hf["num_hidden_layers"]
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        try:
            family_fields = FAMILIES[model_type].read_hf_fields(hf, layers)
        except ValueError as error:
            raise ModelConfigError(str(error)) from error
        family_fields = _read_rope_scaling(hf) | family_fields
        values: dict[str, Any] = dict(
            family=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=layers,
            num_attention_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            top_k=hf.get("num_experts_per_tok", 1),
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.0),
            rope_theta=float(rope),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
        )
        return cls(**(values | family_fields))  # a family's reading of a common key wins (MLA's head_dim)

    @classmethod
    def from_hf_config_file(cls, path: str | Path) -> MoEModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no Hugging Face config at {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _read_rope_scaling(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The model-config YaRN keys of a config.json's ``rope_scaling`` (transformers < 5) or ``rope_parameters``;
    another scaling type, or a YaRN setting transformers has and megatron lacks, is refused by name."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {}
    if kind != "yarn":
        raise ModelConfigError(
            f"config.json has RoPE scaling of type {kind!r}; only YaRN ('yarn') is built here (docs/training.md, "
            "'Model families')"
        )
    for key, plain in (("attention_factor", None), ("truncate", True)):
        if scaling.get(key, plain) != plain:
            raise ModelConfigError(
                f"config.json's YaRN has {key}={scaling[key]!r}, which megatron's YaRN cannot build; "
                f"remove the key (transformers' default: {plain})"
            )
    original = scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096)
    # transformers: without a factor, the ratio of the context to the original one
    factor = scaling.get("factor") or hf.get("max_position_embeddings", original) / original
    return {
        "rope_yarn_factor": float(factor),
        "rope_yarn_original_max_position_embeddings": int(original),
        "rope_yarn_beta_fast": float(scaling.get("beta_fast") or 32.0),  # transformers: `or 32`
        "rope_yarn_beta_slow": float(scaling.get("beta_slow") or 1.0),
        # transformers' cos/sin factor: m(mscale) / m(mscale_all_dim) when both are non-zero, else m(1)
        "rope_yarn_mscale": float(scaling.get("mscale") or 1.0) if scaling.get("mscale_all_dim") else 1.0,
        "rope_yarn_mscale_all_dim": float(scaling.get("mscale_all_dim") or 0.0),
    }


PRESETS: dict[str, MoEModelConfig] = {
    # Trains on 2 CPU cores in minutes: 2 MoE layers, 4 experts, top-2 (conf/model/tiny.yaml alike).
    "tiny": MoEModelConfig(
        vocab_size=80,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=64,
        max_position_embeddings=256,
        rope_theta=10000.0,
    ),
    # A miniature of fine-grained production MoEs (Qwen3 / DeepSeek style: many small experts, top-4 of 32,
    # 6 MoE layers) that still trains on CPU: the shape the routing-stability study runs on
    # (conf/model/small_moe.yaml alike; the shape was chosen by measurement, see
    # conf/experiment/routing_stability.yaml).
    "small_moe": MoEModelConfig(
        vocab_size=80,
        hidden_size=128,
        num_layers=6,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        num_experts=32,
        top_k=4,
        moe_intermediate_size=32,
        max_position_embeddings=256,
        rope_theta=10000.0,
    ),
    # Qwen3-30B-A3B's shape (config only: build it on the meta device).
    "qwen3_30b_a3b": MoEModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        top_k=8,
        moe_intermediate_size=768,
        dense_intermediate_size=0,
        router_aux_loss_coef=0.001,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
    ),
}


def preset(name: str) -> MoEModelConfig:
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}")
    return MoEModelConfig(**asdict(PRESETS[name]))
