"""The forwards a step runs only for the routing diagnostics (``trainer/step_plan.py`` says when).

- ``recording_pass_after``: a forward-only pass over the first mini-batch after an optimizer step,
  recorded, for the ``update`` / ``minibatch`` kinds;
- ``decompose_ratio``: at the last update of a diagnosed step, before its training forward (same
  weights), the log-probs under the loss's routing (the strategy's training-forward routing, recorded
  when it routes freely) and under the old pass's routing replayed. Cost: two forward-only passes
  over that mini-batch (``trainer/diagnostics.py`` has the measurement).

Recordings start and stop in ``routing/recorder.py``; ``trainer/diagnostics.py`` consumes them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gspo_megatron.algorithms.config import AlgorithmConfig
from gspo_megatron.models.micro_batch import MicroBatch
from gspo_megatron.models.schedule import run_schedule
from gspo_megatron.routing.recorder import RoutingRecorder
from gspo_megatron.routing.replay_strategy import ReplayStrategy
from gspo_megatron.trainer.batch import UpdateMicroBatch
from gspo_megatron.trainer.diagnostics import RoutingDiagnostics
from gspo_megatron.trainer.loss_head import LogProbHead
from gspo_megatron.trainer.step_plan import StepPlan

if TYPE_CHECKING:
    from gspo_megatron.models.chunks import ModelChunks


class DiagnosticPasses:
    def __init__(
        self,
        model: ModelChunks,
        plan: StepPlan,
        recorder: RoutingRecorder,
        strategy: ReplayStrategy,
        diagnostics: RoutingDiagnostics,
        head: LogProbHead,
    ) -> None:
        self.model, self.plan, self.recorder, self.strategy = model, plan, recorder, strategy
        self.diagnostics, self.head = diagnostics, head

    def recording_pass_after(self, update: int, step: int, first_micro_batches: Sequence[MicroBatch]) -> None:
        purpose = self.plan.recording_pass_after(update, step)
        if purpose is None or not self.diagnostics.has_old_routing:
            return
        with self.recorder.record() as recording:
            run_schedule(self.model, first_micro_batches, None, forward_only=True)
        self.diagnostics.from_recording_pass(purpose, recording.routing)

    def decompose_ratio(
        self, update: int, step: int, micro_batches: list[UpdateMicroBatch], old_offset: int, algorithm: AlgorithmConfig
    ) -> None:
        old = self.diagnostics.old_used_of(old_offset, len(micro_batches))
        if not (self.plan.decomposes_ratio(update, step) and old):
            return
        started = time.perf_counter()
        free = not self.plan.replays_in_training
        with self.strategy.update(micro_batches, lambda: old, record=free) as loss_routing:
            loss = run_schedule(
                self.model, micro_batches, self.head, forward_only=True, before_forward=loss_routing.before_forward
            )
        with self.recorder.replay(old) as old_routing:
            replayed = run_schedule(
                self.model, micro_batches, self.head, forward_only=True, before_forward=old_routing.before_forward
            )
        self.diagnostics.add_ratio_decomposition(micro_batches, loss, replayed, loss_routing.routing, old, algorithm)
        self.diagnostics.add_decomposition_seconds(time.perf_counter() - started)
