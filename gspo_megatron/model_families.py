"""Model families as data: what differs between the MoE architectures the trainer builds, converts
and serves, one registered ``ModelFamily`` each (``FAMILIES``, keyed by HF ``model_type``).

A family says: its HF config keys (``hf_fields`` writes them, ``read_hf_fields`` reads them back into
``MoEModelConfig`` terms), its transformers classes, whether attention has per-head q/k RMSNorm and
q/k/v biases, its router kind, its checkpoint names for the router, the experts' three projections and
the shared expert, and which of the model config's features its HF architecture can represent (dense
layers, a shared expert). Everything
else -- attention, RMSNorm, RoPE, SwiGLU experts, the QKV and gate/up fusions -- is common, so the
builder (``models/builder.py``), the conversion (``models/conversion.py``, ``models/hf_shapes.py``) and
the embedded engine (``rollout/embedded.py``, ``rollout/embedded_weights.py``) read their differences
from here and name no family.

Families:
- ``qwen3_moe`` (Qwen3-MoE): per-head q/k RMSNorm; softmax over all experts, top-k, renormalised over the
  k when ``norm_topk_prob``; dense layers by ``mlp_only_layers``; checkpoint names ``mlp.gate`` and
  ``mlp.experts.{e}.{gate,up,down}_proj``.
- ``qwen2_moe`` (Qwen2-MoE): no q/k norm, q/k/v biases; softmax top-k, by default NOT renormalised
  (``norm_topk_prob=false``: megatron's softmax over all experts before the top-k); a shared expert
  beside the routed ones, its output scaled by ``sigmoid(shared_expert_gate(x))`` (megatron's
  ``moe_shared_expert_gate``); dense layers as Qwen3-MoE's; checkpoint names as Qwen3-MoE's plus
  ``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate``.
- ``mixtral`` (Mixtral): no q/k norm; softmax top-k always renormalised (transformers'
  ``MixtralTopKRouter``); every layer MoE, no shared expert; ``intermediate_size`` is the expert's FFN
  size; checkpoint names ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w3/w2``
  (gate, up, down).

Router kinds: ``softmax_topk`` is megatron's ``moe_router_score_function="softmax"`` (with
``moe_router_pre_softmax=False`` when the k are renormalised: a softmax over the k chosen logits equals
softmax-over-all, top-k, renormalise). Families with sigmoid scores and an expert bias add a kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

PROJECTIONS = ("gate", "up", "down")  # an expert's SwiGLU: down(silu(gate(x)) * up(x))


class RouterKind(str, Enum):
    softmax_topk = "softmax_topk"  # softmax scores, top-k (renormalised over the k or not)


@dataclass(frozen=True)
class ModelFamily:
    model_type: str  # HF config.json ``model_type``, the registry key and ``model.family``
    title: str  # for messages and the README
    architecture: str  # transformers' causal-LM class (config.json ``architectures``)
    config_class: str  # transformers' config class
    qk_norm: bool  # per-head RMSNorm on queries and keys before RoPE
    qkv_bias: bool  # q/k/v projections have biases (o_proj never)
    router: RouterKind
    moe_module: str  # checkpoint name of a layer's MoE block: ``model.layers.{l}.{moe_module}``
    expert_projections: tuple[str, str, str]  # checkpoint names of the gate, up and down projections
    dense_layers: bool  # the HF architecture can make some layers dense
    shared_expert: str | None  # checkpoint module of the sigmoid-gated shared expert (None: the architecture has none)
    topk_renormalised_always: bool  # the HF router renormalises the k scores whatever the config says
    hf_fields: Callable[[Any], dict[str, Any]]  # MoEModelConfig -> the family's own config.json keys
    read_hf_fields: Callable[[Mapping[str, Any], int], dict[str, Any]]  # config.json, layers -> config kwargs

    def router_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}.gate.weight"

    def expert_name(self, layer: int, expert: int, projection: str) -> str:
        """Checkpoint name of one expert's ``projection`` ("gate", "up" or "down")."""
        which = self.expert_projections[PROJECTIONS.index(projection)]
        return f"model.layers.{layer}.{self.moe_module}.experts.{expert}.{which}.weight"

    def shared_expert_names(self, layer: int) -> dict[str, str]:
        """Checkpoint names of the shared expert's "gate", "up", "down" and its sigmoid's "gate_weight"."""
        if self.shared_expert is None:
            raise ValueError(f"the {self.title} architecture has no shared expert")
        p = f"model.layers.{layer}.{self.moe_module}."
        names = {which: f"{p}{self.shared_expert}.{which}_proj.weight" for which in PROJECTIONS}
        return names | {"gate_weight": f"{p}{self.shared_expert}_gate.weight"}

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
    if hf.get("qkv_bias") is False:
        raise ValueError("config.json has qkv_bias=false: Qwen2-MoE is built with q/k/v biases here")
    return _read_qwen3_moe(hf, layers)


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
    }


FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily(
            model_type="qwen3_moe",
            title="Qwen3-MoE",
            architecture="Qwen3MoeForCausalLM",
            config_class="Qwen3MoeConfig",
            qk_norm=True,
            qkv_bias=False,
            router=RouterKind.softmax_topk,
            moe_module="mlp",
            expert_projections=("gate_proj", "up_proj", "down_proj"),
            dense_layers=True,
            shared_expert=None,
            topk_renormalised_always=False,
            hf_fields=_qwen3_moe_fields,
            read_hf_fields=_read_qwen3_moe,
        ),
        ModelFamily(
            model_type="qwen2_moe",
            title="Qwen2-MoE",
            architecture="Qwen2MoeForCausalLM",
            config_class="Qwen2MoeConfig",
            qk_norm=False,
            qkv_bias=True,
            router=RouterKind.softmax_topk,
            moe_module="mlp",
            expert_projections=("gate_proj", "up_proj", "down_proj"),
            dense_layers=True,
            shared_expert="shared_expert",
            topk_renormalised_always=False,
            hf_fields=_qwen2_moe_fields,
            read_hf_fields=_read_qwen2_moe,
        ),
        ModelFamily(
            model_type="mixtral",
            title="Mixtral",
            architecture="MixtralForCausalLM",
            config_class="MixtralConfig",
            qk_norm=False,
            qkv_bias=False,
            router=RouterKind.softmax_topk,
            moe_module="block_sparse_moe",
            expert_projections=("w1", "w3", "w2"),
            dense_layers=False,
            shared_expert=None,
            topk_renormalised_always=True,
            hf_fields=_mixtral_fields,
            read_hf_fields=_read_mixtral,
        ),
    )
}


def family(model_type: str) -> ModelFamily:
    """The registered family of ``model_type``; ``KeyError`` lists the registered ones."""
    if model_type not in FAMILIES:
        raise KeyError(f"{model_type!r} is not a registered model family; registered: {sorted(FAMILIES)}")
    return FAMILIES[model_type]
