"""Colocated placement (``rollout.placement=colocated``): trainer and engine take turns on the same devices.

What is on each trainer device, phase by phase of one RL step (``RLTrainer.train_step``):

    phase                     engine (weights, KV cache)   trainer weights, optimizer   trainer grad buffers
    rollout (generate)        resident                      resident                     freed
    -> after_generation:      released                      resident                     reallocated (zero)
    old / ref log-probs       released                      resident                     resident
    update                    released                      resident                     resident
    -> before_weight_sync:    resumed                       resident                     freed
    weight sync, evaluation   resident                      resident                     freed

The trainer's weights stay: the weight sync reads them while the engine is back. What else of the
trainer leaves the device is configured apart and holds in every phase: Adam in host memory
(``optimizer.cpu_offload``, ``optimizer.precision_aware``), the reference model between its passes
(``trainer.reference_offload``). The gradient buffers are megatron's own DDP buffers, freed and
reallocated by megatron (``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers``:
their storage resized to 0 and back, every view kept); they hold nothing between steps (each update
zeroes them first), so nothing is copied. The engine's release and resume are ``RolloutEngine``'s
(SGLang: ``/release_memory_occupation`` and ``/resume_memory_occupation`` on every server; the embedded
engine: its model to host memory and back where its device is not the host), called by the driver
between two barriers so that no rank allocates while the engine still holds its share, or the engine
while a rank still holds its gradients.

The engine is launched (``loop/build.py``) after the trainer's state is built and its gradient buffers
freed (``before_engine_launch``), so a colocated server starts beside what the trainer keeps during
rollout, as in every later step. Separate placement (the default) uses ``SeparatePlacement``: the same
calls, nothing moves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from gspo_megatron.policy.parallel.device import cuda_kernels

if TYPE_CHECKING:
    from gspo_megatron.policy.models.chunks import ModelChunks
    from gspo_megatron.rollout.engine import RolloutEngine


class EnginePlacement(Protocol):
    """The hand-over points around generation and weight sync (``rollout.placement``)."""

    def before_engine_launch(self) -> None: ...

    def attach(self, engine: RolloutEngine | None) -> None: ...

    def after_generation(self) -> None: ...

    def before_weight_sync(self) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class SeparatePlacement:
    """The engine keeps its memory: the hand-over points do nothing."""

    def before_engine_launch(self) -> None:
        pass

    def attach(self, engine: RolloutEngine | None) -> None:
        pass

    def after_generation(self) -> None:
        pass

    def before_weight_sync(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


class ColocatedHandOver:
    """The hand-over between engine and trainer (module docstring); collective over the world. Built with
    the trainer's model, before the engine; ``attach`` gives it the driver's engine (None elsewhere)."""

    def __init__(self, model: ModelChunks):
        self.engine: RolloutEngine | None = None
        self.model = model
        self.engine_released = False
        self.grads_freed = False
        self.releases = self.resumes = 0  # hand-overs so far (logged: every step shows both)

    def before_engine_launch(self) -> None:
        """Every rank frees its gradient buffers before the driver launches the engine, which then starts
        beside the trainer's weights and optimizer state only (as in the rollout phase)."""
        self._free_grads()
        dist.barrier()

    def attach(self, engine: RolloutEngine | None) -> None:
        self.engine = engine

    def _free_grads(self) -> None:
        if not self.grads_freed:
            self.model.offload_grad_buffers(synchronize=cuda_kernels(), empty_cache=cuda_kernels())
            self.grads_freed = True

    def after_generation(self) -> None:
        """The engine gives its memory back; then every rank's gradient buffers are reallocated."""
        if self.engine is not None:
            self.engine.release_memory()
        self.engine_released = True
        self.releases += 1
        dist.barrier()
        if self.grads_freed:
            self.model.restore_grad_buffers(synchronize=cuda_kernels())
            self.grads_freed = False

    def before_weight_sync(self) -> None:
        """Every rank frees its gradient buffers; then the engine takes its memory again."""
        self._free_grads()
        dist.barrier()
        if self.engine_released:
            if self.engine is not None:
                self.engine.resume_memory()
            self.engine_released = False
            self.resumes += 1

    def metrics(self) -> dict[str, float]:
        """Hand-overs since the start of this process: after step k's weight sync, k of each."""
        return {"colocation/engine_releases": float(self.releases), "colocation/engine_resumes": float(self.resumes)}
