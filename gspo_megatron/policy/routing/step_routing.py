"""``StepRouting``: everything a step does with the routers, behind two hooks and a result.

The trainer calls, per step:

    with routing.old_pass(step, micro_batches) as before_forward:   # around the old-policy phase
        ... the old-policy forward (none when pi_old is the engine's) ...
    for each update:
        with routing.update(u, micro_batches) as before_forward:     # around forward-backward + step
            ... forward-backward, optimizer step ...
    result = routing.finish(step + 1)                                # reduced over ranks: metrics, records

and never asks which replay mode runs or which forward is recorded. Inside:

- the replay strategy (``policy/routing/replay_strategy.py``: none / R2 / R3) says what each forward
  replays; the ``RoutingRecorder`` (``policy/routing/recorder.py``) starts and stops every recording;
- the plan (``policy/routing/plan.py``) says which training forward is recorded and which extra passes run;
- the R3 targets (the engine's experts, cut to this rank's tokens of its MoE layers);
- the diagnostics (``policy/routing/diagnostics.py``) consume the recordings; their extra forwards run here:
  before the last update's training forward of a diagnosed step, the ratio decomposition's two
  forward-only passes (same weights: the loss's routing, and the old pass's routing replayed); after
  an optimizer step, the recording pass over the first mini-batch.

An update's context spans its optimizer step, because the recording pass follows that step; the
replayed routing stays loaded meanwhile (an optimizer step runs no router). A forward that raises
leaves through the recorder's context, which resets the routers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from gspo_megatron.contracts.micro_batch import MicroBatch, StepMicroBatch, UpdateMicroBatch
from gspo_megatron.contracts.phases import RoutingResult
from gspo_megatron.policy.models.schedule import BeforeForward, LossCallback, run_schedule
from gspo_megatron.policy.parallel.mesh import ParallelMesh
from gspo_megatron.policy.routing.diagnostics import RoutingDiagnostics
from gspo_megatron.policy.routing.plan import RoutingPlan
from gspo_megatron.policy.routing.recorder import Routing, RoutingRecorder
from gspo_megatron.policy.routing.replay import RoutingReplay, rollout_targets
from gspo_megatron.policy.routing.replay_strategy import build_replay_strategy

if TYPE_CHECKING:
    from gspo_megatron.policy.models.chunks import ModelChunks


class StepRouting:
    def __init__(
        self,
        plan: RoutingPlan,
        replay: RoutingReplay | None,
        model: ModelChunks,
        mesh: ParallelMesh,
        *,
        log_prob_head: LossCallback[Any],
        stage_moe_layers: list[int],
        num_experts: int,
        clip: tuple[float, float],
    ) -> None:
        """``replay``: megatron's routers patched for record/replay (None: no MoE layers);
        ``log_prob_head``: forward-only log-probs at the rollout temperature (the ratio decomposition's
        passes); ``stage_moe_layers``: this pipeline stage's MoE layers (where R3's targets go);
        ``clip``: the configured (eps_low, eps_high) the ratio decomposition splits by."""
        self.plan, self.model, self.mesh = plan, model, mesh
        self.head, self.stage_moe_layers, self.clip = log_prob_head, stage_moe_layers, clip
        self.recorder = RoutingRecorder(replay)
        self.strategy = build_replay_strategy(plan.routing_replay, self.recorder, self._engine_targets)
        self.diagnostics = RoutingDiagnostics(plan, mesh, num_experts)
        self.step = 0
        self.first_micro_batches: Sequence[MicroBatch] = []
        self.old_routing: Routing = []  # the old pass's routing, what R2 replays (empty: none recorded)
        self.offset = 0  # the first micro-batch of the next update, in the step's order

    # --- hook 1: the old-policy phase ------------------------------------------------------------
    @contextmanager
    def old_pass(self, step: int, micro_batches: Sequence[StepMicroBatch]) -> Iterator[BeforeForward | None]:
        """Begins step ``step`` over ``micro_batches`` (all of its, in update order); the old-policy
        forward runs inside. With pi_old from the engine no forward runs and nothing is recorded."""
        self.step, self.offset, self.old_routing = step, 0, []
        self.diagnostics.begin_step(micro_batches)
        if self.plan.engine_old_policy:
            yield None
            return
        with self.strategy.old_pass(micro_batches) as recording:
            yield recording.before_forward
        old_routing = self.strategy.old_policy_routing(recording)
        self.old_routing = old_routing or []
        self.diagnostics.from_old_pass(
            step, micro_batches, self._engine_targets, old_routing, recording.routing, recording.margins
        )

    # --- hook 2: each update ---------------------------------------------------------------------
    @contextmanager
    def update(self, update: int, micro_batches: list[UpdateMicroBatch]) -> Iterator[BeforeForward | None]:
        """Update ``update``'s forward-backward and optimizer step run inside."""
        step, first = self.step, self.offset
        if update == 0:
            self.first_micro_batches = micro_batches
        self._decompose_ratio(update, micro_batches)
        record = self.plan.records_training_forward(update, step)
        old_routing = partial(self._old_routing_of, first, len(micro_batches))
        with self.strategy.update(micro_batches, old_routing, record=record) as routing:
            yield routing.before_forward
        if record:
            self.diagnostics.from_training_forward(routing.routing, first, micro_batches, self._engine_targets, step)
        self._recording_pass_after(update)
        self.offset += len(micro_batches)

    # --- the result ------------------------------------------------------------------------------
    def finish(self, logged_step: int) -> RoutingResult:
        """This step's diagnostics reduced over ranks, as ``logged_step``'s metrics and routing.jsonl records."""
        return self.diagnostics.finish_step(logged_step)

    # --- inside ----------------------------------------------------------------------------------
    def _engine_targets(self, micro_batch: MicroBatch) -> list[torch.Tensor]:
        """R3: the engine's experts of this rank's tokens, one [tokens, k] per MoE layer of its stage."""
        if micro_batch.routed_experts is None:
            raise RuntimeError(
                "rollout routing replay needs the engine's routed experts, but the rollout batch has none "
                "(the engine was not asked for them, or returned none)"
            )
        mesh, layout = self.mesh, self.mesh.layout
        return rollout_targets(
            micro_batch.routed_experts,
            self.stage_moe_layers,
            mesh.tp_rank,
            layout.tp,
            layout.use_sequence_parallel,
            layout.cp,
            mesh.cp_rank if layout.cp > 1 else 0,
        )

    def _old_routing_of(self, first: int, count: int) -> Routing:
        """The old pass's routing of micro-batches ``first .. first + count - 1`` (what R2 replays)."""
        if first + count > len(self.old_routing):
            raise RuntimeError(
                f"old-policy replay needs recorded routing for micro-batches {first}..{first + count - 1} "
                f"but only {len(self.old_routing)} were recorded"
            )
        return self.old_routing[first : first + count]

    def _recording_pass_after(self, update: int) -> None:
        """After optimizer step ``update``: the first mini-batch's routing, recorded (forward only)."""
        purpose = self.plan.recording_pass_after(update, self.step)
        if purpose is None or not self.diagnostics.has_old_routing:
            return
        with self.recorder.record() as recording:
            run_schedule(self.model, self.first_micro_batches, None, forward_only=True)
        self.diagnostics.from_recording_pass(purpose, recording.routing)

    def _decompose_ratio(self, update: int, micro_batches: list[UpdateMicroBatch]) -> None:
        """Before the last update's training forward (same weights): log-probs under the loss's routing
        (recorded when training routes freely) and under the old pass's routing replayed."""
        old = self.diagnostics.old_used_of(self.offset, len(micro_batches))
        if not (self.plan.decomposes_ratio(update, self.step) and old):
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
        self.diagnostics.add_ratio_decomposition(micro_batches, loss, replayed, loss_routing.routing, old, self.clip)
        self.diagnostics.add_decomposition_seconds(time.perf_counter() - started)
