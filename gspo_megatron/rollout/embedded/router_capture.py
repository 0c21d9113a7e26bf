"""Routed experts of the embedded engine's forwards (``rollout/embedded/engine.py``): each MoE layer's top-k expert
indices, by forward hooks on transformers' routers or handed over by the lean forward."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


class RouterCapture:
    """Forward hooks on every MoE router; collects top-k indices [B, S, k] per layer per forward."""

    def __init__(self, model: PreTrainedModel):
        self._routers = {
            i: layer.mlp.gate
            for i, layer in enumerate(model.model.layers)
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")
        }
        self._num_layers = len(model.model.layers)
        self._top_k = model.config.num_experts_per_tok
        self._latest: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self):
        for layer, router in self._routers.items():
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def record(module, inputs, output):
            self.record(layer, output[2].detach())  # (router_logits, scores, top-k indices)

        return record

    def record(self, layer: int, top_k_indices: torch.Tensor) -> None:
        """Layer ``layer``'s top-k expert indices [B * S, k] of the latest forward (the hook or the lean forward)."""
        self._latest[layer] = top_k_indices

    def select_rows(self, batch: int, rows: torch.Tensor) -> None:
        """The latest forward's indices (a batch of ``batch`` rows) as if its batch had been its rows ``rows``
        (repeats allowed)."""
        for layer, indices in self._latest.items():
            by_row = indices.reshape(batch, -1, self._top_k)
            self._latest[layer] = by_row.index_select(0, rows.to(indices.device)).reshape(-1, self._top_k)

    def take(self, batch: int, last: int) -> torch.Tensor:
        """int32 [B, last, num_layers, top_k] for the last ``last`` positions of the latest forward."""
        out = torch.full((batch, last, self._num_layers, self._top_k), -1, dtype=torch.int32)
        for layer, indices in self._latest.items():
            out[:, :, layer] = indices.reshape(batch, -1, self._top_k)[:, -last:].to(torch.int32).cpu()
        self._latest.clear()
        return out
