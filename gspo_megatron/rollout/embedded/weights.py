"""Load Hugging-Face checkpoint-named tensors into a transformers 5.x MoE model of any family in place.

Design decisions:
- The trainer exports the names ``save_pretrained`` writes to safetensors (per-expert, under the
  family's names: Qwen3-MoE's ``mlp.experts.{e}.{gate,up,down}_proj.weight``, Mixtral's
  ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``; ``core/model_families.py``). transformers 5.x holds
  experts FUSED in memory under ``mlp.experts`` for every family, which was checked by saving a tiny
  model of each and comparing:
      mlp.experts.gate_up_proj  [E, 2 * I, H]  -- rows [0, I) are expert e's gate_proj, [I, 2I) its up_proj
      mlp.experts.down_proj     [E, H, I]      -- expert e's down_proj
  so a per-expert tensor is copied into its slice of the fused parameter. The fused in-memory names
  are accepted too (a whole-layer update in one tensor).
- Streaming: each tensor is resolved, checked and copied as it arrives; nothing is buffered. A bad
  name or shape raises at once (the tensors before it are already loaded; the caller resends).
- Tied embeddings (``tie_word_embeddings``): ``lm_head.weight`` and ``model.embed_tokens.weight`` are
  the same parameter, so either name updates both.
- Tensors are cast to the parameter's dtype/device on copy (the trainer may export bf16 or fp32).
- A name is resolved once and its target kept (``resolve``): every weight sync streams the same names, and
  resolving (regexes, the layer's module lookups) was half the engine's side of the main job's sync. A
  target holds the parameter object, whose ``.data`` the copy reads at each load, so moving the model
  (``release_memory``) leaves it valid.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

import torch

from gspo_megatron.core.model_families import family


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor lands: a parameter and the index of the slice it fills."""

    parameter: torch.Tensor  # a parameter, or the expert-bias buffer
    index: tuple  # () for the whole parameter, (expert, row-slice) for fused experts
    shape: tuple[int, ...]


class HfWeightLoader:
    """Resolves checkpoint names onto a transformers MoE causal LM's parameters and copies tensors in."""

    def __init__(self, model: Any):  # e.g. a transformers Qwen3MoeForCausalLM or MixtralForCausalLM
        self._model = model
        self._family = family(model.config.model_type)
        self._expert_name = re.compile(self._family.expert_name_pattern())
        # remove_duplicate=False keeps both names of a tied parameter; checkpoint names of the MoE block
        # (``core/model_families.py``: Mixtral's ``block_sparse_moe``) as well as the in-memory ``mlp``
        self._direct = dict(model.named_parameters(remove_duplicate=False))
        # the routers' expert bias (GLM-4.5, DeepSeek-V3) is a buffer: set from the load, not trained
        self._direct.update(
            {name: b for name, b in model.named_buffers() if name.endswith(".gate.e_score_correction_bias")}
        )
        self._num_layers = model.config.num_hidden_layers
        self._memory_prefix = re.compile(rf"^(model\.layers\.\d+\.){re.escape(self._family.moe_module)}\.")
        self._checkpoint_prefix = re.compile(r"^(model\.layers\.\d+\.)mlp\.")
        self._resolved: dict[str, WeightTarget] = {}  # name -> its target, once resolved (module docstring)

    def checkpoint_names(self) -> list[str]:
        """Every name a full checkpoint of this model has (per-expert names, as on disk)."""
        names = []
        for name in self._direct:
            match = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
            if match is None:
                names.append(self._checkpoint_prefix.sub(rf"\g<1>{self._family.moe_module}.", name))
                continue
            layer = int(name.split(".")[2])
            experts = self._experts_of(layer)
            projections = ("gate", "up") if match.group(2) == "gate_up_proj" else ("down",)
            names += [self._family.expert_name(layer, e, p) for e in range(experts.num_experts) for p in projections]
        return names

    def resolve(self, name: str) -> WeightTarget:
        """Map a checkpoint (or in-memory) name onto its parameter slice; KeyError names the problem."""
        target = self._resolved.get(name)
        if target is None:
            target = self._resolved[name] = self._resolve(name)
        return target

    def _resolve(self, name: str) -> WeightTarget:
        direct = name if name in self._direct else self._memory_prefix.sub(r"\g<1>mlp.", name)
        if direct in self._direct:
            parameter = self._direct[direct]
            return WeightTarget(parameter, (), tuple(parameter.shape))
        match = self._expert_name.match(name)
        if match is None:
            raise KeyError(self._unknown_message(name))
        layer, expert = int(match.group(1)), int(match.group(2))
        projection = self._family.projection_of(match.group(3))
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
        if projection == "down":
            return WeightTarget(experts.down_proj, (expert,), tuple(experts.down_proj.shape[1:]))
        rows = slice(0, inter) if projection == "gate" else slice(inter, 2 * inter)
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
                f"'{self._family.expert_name(0, 3, 'gate')}', '{self._family.router_name(0)}', "
                "'model.norm.weight', 'lm_head.weight'"
            )
        )
        return (
            f"unknown weight name {name!r} for this {self._family.title} model (expected Hugging-Face "
            f"checkpoint names as save_pretrained writes them); {hint}"
        )
