"""``RoutingPlan``: which forwards of one RL step record or replay a routing, resolved once.

Every routing decision of a step is answered here, as a pure function of (plan, step, update), so
every rank agrees without communicating and no phase combines mode flags itself
(``policy/routing/step_routing.py`` asks it; the trainer builds it from the config):

- ``engine_old_policy``: pi_old is the engine's log-probs (no old-policy forward runs);
- ``routing_replay``: the replay strategy (``policy/routing/replay_strategy.py``);
- ``records_training_forward(update, step)``: which update's training forward is recorded for the
  routing diagnostics -- update 1 (run after exactly one optimizer step: the GSPO paper's "experts
  that change after one gradient update", for free), or, with pi_old from the engine (no old-policy
  pass), update 0 (before any optimizer step the policy *is* the old policy); never when training
  replays a routing (a replayed forward does not route freely);
- ``recording_pass_after(update, step)``: an extra forward-only recording pass over the first
  mini-batch after optimizer step ``update``: for ``update`` when the free measurement above is not
  available, for ``minibatch`` after every update;
- ``decomposes_ratio(update, step)``: the ratio decomposition's two forward-only passes (last update);
- ``due(kind, step)``: the diagnostic kinds (``routing.kinds``) of this step; none without MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.policy.routing.config import DiagnosticKind, RoutingConfig
from gspo_megatron.policy.routing.replay import ReplayMode
from gspo_megatron.policy.routing.replay_strategy import replays

# the kinds measured against the old policy's routing recorded in the first update's training forward
_FROM_FIRST_TRAINING_FORWARD = (DiagnosticKind.update, DiagnosticKind.minibatch, DiagnosticKind.rollout_vs_train)


@dataclass(frozen=True)
class RecordingPass:
    """An extra recording pass over the first mini-batch after an optimizer step, and what it is for."""

    compares_to_old_policy: bool  # the "update" kind: vs the old policy's routing
    compares_to_previous: bool  # the "minibatch" kind: vs the same pass after the previous update


@dataclass(frozen=True)
class RoutingPlan:
    routing_replay: ReplayMode  # routing.replay
    engine_old_policy: bool  # trainer.old_log_probs=rollout: no old-policy forward runs (or records)
    updates: int  # trainer.updates_per_rollout
    has_routers: bool  # an MoE model: routing is measured
    diagnostics: RoutingConfig  # the config's routing section
    turns: int = 0  # multi-turn trajectories' most turns (rollout.agent.max_turns): diagnosed per turn too; 0: not

    @property
    def replays_in_training(self) -> bool:
        """R2/R3: training forwards replay a routing, so none of them routes freely."""
        return replays(self.routing_replay)

    def due(self, kind: DiagnosticKind, step: int) -> bool:
        return self.has_routers and self.diagnostics.is_due(step, kind)

    def records_training_forward(self, update: int, step: int) -> bool:
        if self.replays_in_training:
            return False
        if self.engine_old_policy:
            return update == 0 and any(self.due(kind, step) for kind in _FROM_FIRST_TRAINING_FORWARD)
        return update == 1 and self.due(DiagnosticKind.update, step)

    def recording_pass_after(self, update: int, step: int) -> RecordingPass | None:
        free_update = not self.replays_in_training and self.updates > 1 and not self.engine_old_policy
        compares_to_old = update == 0 and self.due(DiagnosticKind.update, step) and not free_update
        compares_to_previous = self.due(DiagnosticKind.minibatch, step) and self.updates > 1
        if not (compares_to_old or compares_to_previous):
            return None
        return RecordingPass(compares_to_old, compares_to_previous)

    def decomposes_ratio(self, update: int, step: int) -> bool:
        return update == self.updates - 1 and self.due(DiagnosticKind.ratio_decomposition, step)
