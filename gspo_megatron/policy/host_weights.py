"""A frozen module's parameters kept in host memory and brought to the device for one pass at a time.

Used for the KL reference (``trainer.reference_offload``, ``policy/reference.py``): between its
forward passes its weights cost the device nothing.

Design decisions:
- One flat host buffer per dtype, the parameters laid out in the order of their current storage and
  offset, so parameters that shared one storage back to back (the grouped experts' [E, out, in]
  projections, ``policy/models/grouped_experts.py:share_one_storage``) still do, on the host and on the
  device: the grouped GEMMs keep taking them as one view, without a copy.
- ``on_device()`` copies each flat buffer to the device in one transfer (pinned host memory, an
  asynchronous copy on the current stream, so the forward that follows is ordered after it) and points
  every parameter at its slice; on leaving, the parameters point back at the host buffer and the device
  copy is dropped (the caching allocator keeps its blocks for the update that follows). Per pass the
  device holds the whole copy: one transfer of the stage's reference weights per RL step (Qwen3-30B-A3B,
  tp4_ep8: 7.5 GiB, ~0.3 s at a pinned host-to-device rate of 25 GB/s) instead of a transfer per layer and
  micro-batch.
- Without CUDA the compute device is the host: ``on_device()`` keeps the parameters where they are (the
  same tensors, no copy), so every CPU run goes through the same calls and gives the same numbers.
- Buffers (not parameters: rotary frequencies, an expert bias) stay where the module put them: a few KiB.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gspo_megatron.policy.parallel.device import compute_device, cuda_kernels


@dataclass(frozen=True)
class _Slot:
    param: torch.nn.Parameter
    offset: int  # elements into its dtype's flat buffer


class HostResidentWeights:
    """Moves ``module``'s parameters into flat host buffers now; ``on_device()`` brings them in for a pass."""

    def __init__(self, module: torch.nn.Module):
        params = list({id(p): p for p in module.parameters()}.values())
        params.sort(key=lambda p: (str(p.dtype), p.untyped_storage().data_ptr(), p.storage_offset()))
        self._slots: dict[torch.dtype, list[_Slot]] = {}
        self.host: dict[torch.dtype, torch.Tensor] = {}
        sizes: dict[torch.dtype, int] = {}
        for param in params:
            self._slots.setdefault(param.dtype, []).append(_Slot(param, sizes.get(param.dtype, 0)))
            sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
        for dtype, size in sizes.items():
            flat = torch.empty(size, dtype=dtype, device="cpu", pin_memory=cuda_kernels())
            for slot in self._slots[dtype]:
                flat[slot.offset : slot.offset + slot.param.numel()].copy_(slot.param.detach().reshape(-1))
            self.host[dtype] = flat
        self._point_at(self.host)
        self.device = compute_device()

    @property
    def nbytes(self) -> int:
        """Host bytes held (the module's parameters, each once)."""
        return sum(flat.numel() * flat.element_size() for flat in self.host.values())

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The parameters on the compute device for the block, back in host memory after it."""
        resident = {dtype: flat.to(self.device, non_blocking=True) for dtype, flat in self.host.items()}
        self._point_at(resident)
        try:
            yield
        finally:
            self._point_at(self.host)
            del resident

    def _point_at(self, flats: dict[torch.dtype, torch.Tensor]) -> None:
        for dtype, slots in self._slots.items():
            flat = flats[dtype]
            for slot in slots:
                slot.param.data = flat[slot.offset : slot.offset + slot.param.numel()].view(slot.param.shape)
