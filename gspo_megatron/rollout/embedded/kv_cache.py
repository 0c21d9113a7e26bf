"""The embedded engine's KV cache between decode steps and turns: the forward's cache argument, which rows a
cache keeps, and one trajectory's cache kept between its turns (``rollout/embedded/engine.py``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, cache_utils
from transformers.cache_utils import DynamicCache, DynamicLayer


def cache_argument(model_class: type[PreTrainedModel]) -> str:
    """transformers 5.x renamed the forward's KV-cache argument (``inspect`` follows the deprecation wrapper)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


# transformers' cache of a linear-attention layer (gated DeltaNet: its conv and recurrent states), where it has one
LINEAR_ATTENTION_CACHE = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())


def keep_cache_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep rows ``index`` of every layer's cache, in that order: an attention layer's keys and values
    (``batch_select_indices``); a linear-attention layer's conv and recurrent states through its
    ``reorder_cache`` -- transformers gives it no ``batch_select_indices``, and its reorder is the same
    index_select along the batch (a layer with both kinds reorders both); a layer that holds nothing
    (transformers' ``DummyLayer``) is left as it is."""
    for layer in cache.layers:
        if isinstance(layer, LINEAR_ATTENTION_CACHE):
            layer.reorder_cache(index)
        elif isinstance(layer, DynamicLayer):
            layer.batch_select_indices(index)
        elif getattr(layer, "keys", None) is not None:
            raise TypeError(f"keep_cache_rows: a {type(layer).__name__} cache layer holds rows it cannot select")


@dataclass(frozen=True)
class KeptCache:
    """One trajectory's KV cache between its turns: per layer (keys, values) [kv_heads, positions, head_dim]
    of the positions it fed, padding removed."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[1]) if self.layers else 0

    @classmethod
    def of_row(cls, cache: DynamicCache, mask: torch.Tensor, row: int) -> KeptCache:
        """Row ``row`` of the batch's cache (its real positions: ``mask`` [B, >= cached], 1 where real)."""
        real = mask[row, : cache.get_seq_length()].bool()
        layers = []
        for layer in cache.layers:
            if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
                raise TypeError(f"a trajectory's session keeps attention caches, not a {type(layer).__name__}")
            layers.append((layer.keys[row][:, real].clone(), layer.values[row][:, real].clone()))
        return cls(tuple(layers))
