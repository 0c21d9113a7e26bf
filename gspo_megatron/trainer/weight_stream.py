"""Weight sync from the trainer's ranks into the rollout engine, bounded in memory and re-readable.

Design decisions:
- The weights travel as a stream of (HF name, full tensor): ``models.conversion.export_hf_tensors``
  gathers one parameter at a time and the engine decides the bucket (SGLang: one
  ``/update_weights_from_distributed`` per ``weight_bucket_bytes``; the embedded engine loads each
  tensor as it comes). No rank holds more than the engine's bucket plus one parameter's gather beyond
  its shard; the driver never holds the model (it did: the engine listed the whole export).
- The engine may read the weights more than once (SGLang retries a failed distributed update
  through the disk path), and only the driver knows whether it will. Every pass is a fresh collective
  export, so the other ranks must join it: before each pass the driver broadcasts MORE (1) to every
  rank, after the engine returned DONE (0); ``follow_weight_stream`` is the other ranks' half.
- A pass the engine abandoned half-way (a bucket refused by a server) is drained before anything
  else happens on the driver: the other ranks are inside that pass's collectives and would deadlock
  against a new pass or the DONE broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gspo_megatron.models.conversion import export_hf_tensors
from gspo_megatron.rollout.engine import RolloutEngine
from gspo_megatron.weights.named_tensors import NamedTensor

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from gspo_megatron.models.chunks import ModelChunks
    from gspo_megatron.models.config import MoEModelConfig
    from gspo_megatron.parallel.mesh import ParallelMesh

MORE, DONE = 1, 0


class DriverWeightStream:
    """The driver's re-iterable view of the export: each ``iter()`` announces and starts one pass."""

    def __init__(self, export_pass: Callable[[], Iterator[NamedTensor]], announce: Callable[[int], None]):
        self._export_pass = export_pass
        self._announce = announce
        self._active: Iterator[NamedTensor] | None = None
        self.passes = 0

    def __iter__(self) -> Iterator[NamedTensor]:
        self._drain()
        self._announce(MORE)
        self.passes += 1
        self._active = self._export_pass()
        return self._active

    def close(self) -> None:
        """Finish an abandoned pass, then release the other ranks (DONE)."""
        self._drain()
        self._announce(DONE)

    def _drain(self) -> None:
        if self._active is not None:
            for _ in self._active:  # the other ranks are still in this pass's collectives
                pass
            self._active = None


def follow_weight_stream(export_pass: Callable[[], Iterator[NamedTensor]], receive: Callable[[], int]) -> int:
    """A non-driver rank's half: join one export pass per MORE until DONE; returns the passes made."""
    passes = 0
    while receive() == MORE:
        for _ in export_pass():
            pass
        passes += 1
    return passes


def sync_engine_weights(
    engine: RolloutEngine | None,
    model: GPTModel | ModelChunks,
    model_cfg: MoEModelConfig,
    mesh: ParallelMesh,
    version: int,
) -> int:
    """Stream the policy's HF-named weights into ``engine`` (the driver's; None elsewhere); ``model``: one
    model chunk or this rank's ``ModelChunks``.
    Collective on every rank; returns the export passes made (2 when the engine read twice)."""

    def export_pass() -> Iterator[NamedTensor]:
        return export_hf_tensors(model, model_cfg, mesh)

    world = dist.get_world_size() if dist.is_initialized() else 1
    signal = torch.zeros(1, dtype=torch.int64, device=mesh.device if mesh is not None else "cpu")

    def announce(value: int) -> None:
        if world > 1:
            signal.fill_(value)
            dist.broadcast(signal, src=0)

    def receive() -> int:
        dist.broadcast(signal, src=0)
        return int(signal.item())

    if engine is None:
        return follow_weight_stream(export_pass, receive)
    stream = DriverWeightStream(export_pass, announce)
    try:
        engine.update_weights(stream, version)
    finally:
        stream.close()
    return stream.passes
