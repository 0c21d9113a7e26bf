"""Load Hugging-Face checkpoint-named tensors into a transformers 5.x Qwen3-MoE model in place.

Design decisions:
- The trainer exports the names ``save_pretrained`` writes to safetensors (per-expert
  ``mlp.experts.{e}.{gate,up,down}_proj.weight``). transformers 5.x holds experts FUSED in memory,
  which was checked by saving a tiny model and comparing:
      mlp.experts.gate_up_proj  [E, 2 * I, H]  -- rows [0, I) are expert e's gate_proj, [I, 2I) its up_proj
      mlp.experts.down_proj     [E, H, I]      -- expert e's down_proj
  so a per-expert tensor is copied into its slice of the fused parameter. The fused in-memory names
  are accepted too (a whole-layer update in one tensor).
- Streaming: each tensor is resolved, checked and copied as it arrives; nothing is buffered. A bad
  name or shape raises at once (the tensors before it are already loaded; the caller resends).
- Tied embeddings (``tie_word_embeddings``): ``lm_head.weight`` and ``model.embed_tokens.weight`` are
  the same parameter, so either name updates both.
- Tensors are cast to the parameter's dtype/device on copy (the trainer may export bf16 or fp32).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

import torch

_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor lands: a parameter and the index of the slice it fills."""

    parameter: torch.nn.Parameter
    index: tuple  # () for the whole parameter, (expert, row-slice) for fused experts
    shape: tuple[int, ...]


class HfWeightLoader:
    """Resolves checkpoint names onto a ``Qwen3MoeForCausalLM``'s parameters and copies tensors in."""

    def __init__(self, model: Any):  # a transformers Qwen3MoeForCausalLM
        self._model = model
        # remove_duplicate=False keeps both names of a tied parameter
        self._direct = dict(model.named_parameters(remove_duplicate=False))
        self._num_layers = model.config.num_hidden_layers

    def checkpoint_names(self) -> list[str]:
        """Every name a full checkpoint of this model has (per-expert names, as on disk)."""
        names = []
        for name in self._direct:
            match = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
            if match is None:
                names.append(name)
                continue
            experts = self._experts_of(int(name.split(".")[2]))
            projections = ("gate_proj", "up_proj") if match.group(2) == "gate_up_proj" else ("down_proj",)
            names += [f"{match.group(1)}.{e}.{p}.weight" for e in range(experts.num_experts) for p in projections]
        return names

    def resolve(self, name: str) -> WeightTarget:
        """Map a checkpoint (or in-memory) name onto its parameter slice; KeyError names the problem."""
        if name in self._direct:
            parameter = self._direct[name]
            return WeightTarget(parameter, (), tuple(parameter.shape))
        match = _EXPERT_NAME.match(name)
        if match is None:
            raise KeyError(self._unknown_message(name))
        layer, expert, projection = int(match.group(1)), int(match.group(2)), match.group(3)
        experts = self._experts_of(layer)
        if experts is None:
            raise KeyError(
                f"{name!r}: layer {layer} has no routed experts in this model (a dense MLP "
                f"layer per mlp_only_layers/decoder_sparse_step, or layer index >= "
                f"{self._num_layers}); check that trainer and engine model configs agree"
            )
        if expert >= experts.num_experts:
            raise KeyError(
                f"{name!r}: expert {expert} does not exist, the model has "
                f"{experts.num_experts} experts per layer; model configs disagree"
            )
        inter = experts.intermediate_dim
        if projection == "down_proj":
            return WeightTarget(experts.down_proj, (expert,), tuple(experts.down_proj.shape[1:]))
        rows = slice(0, inter) if projection == "gate_proj" else slice(inter, 2 * inter)
        return WeightTarget(experts.gate_up_proj, (expert, rows), (inter, experts.gate_up_proj.shape[-1]))

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        target = self.resolve(name)
        if tuple(tensor.shape) != target.shape:
            raise ValueError(
                f"{name!r} has shape {tuple(tensor.shape)}, the engine's model expects "
                f"{target.shape}; the trainer and engine model configs disagree"
            )
        destination = target.parameter.data[target.index] if target.index else target.parameter.data
        destination.copy_(tensor.to(dtype=destination.dtype, device=destination.device))

    def _experts_of(self, layer: int):
        if layer >= self._num_layers:
            return None
        experts = getattr(self._model.model.layers[layer].mlp, "experts", None)
        return experts if hasattr(experts, "gate_up_proj") else None

    def _unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, self.checkpoint_names(), n=3, cutoff=0.6)
        hint = (
            f"closest valid names: {close}"
            if close
            else (
                "valid names look like 'model.layers.0.self_attn.q_proj.weight', "
                "'model.layers.0.mlp.experts.3.gate_proj.weight', 'model.layers.0.mlp.gate.weight', "
                "'model.norm.weight', 'lm_head.weight'"
            )
        )
        return (
            f"unknown weight name {name!r} for this Qwen3-MoE model (expected Hugging-Face "
            f"checkpoint names as save_pretrained writes them); {hint}"
        )
