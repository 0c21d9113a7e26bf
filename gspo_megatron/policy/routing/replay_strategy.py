"""Routing Replay as one strategy object per mode: the trainer and the diagnostics call its hooks and
never branch on ``routing.replay`` themselves.

A step runs the old-log-prob pass, then one training forward per mini-batch (see loop/trainer.py):

    mode        old-log-prob pass                         each training forward
    none        record the routing (diagnostics only)     route freely
    old_policy  RECORD the routing (R2)                   REPLAY what the old pass recorded
    rollout     REPLAY the engine's experts, observed     REPLAY the engine's experts (R3)

Design decisions:
- The strategies say *what* a forward replays (``policy/routing/step_routing.py`` holds the run's one
  strategy and is all the trainer sees); ``policy/routing/recorder.py``'s ``RoutingRecorder`` owns
  every start and stop (each hook returns one of its context managers, which yields a
  ``Recording``). Without MoE layers every recording is empty.
- ``old_policy_routing`` picks, from the old pass's recording, the routing R2 replays and the
  diagnostics compare against (None under R3, where the pass itself replays); the recording's own
  ``routing`` is what the trainer actually routed with (for the engine-vs-trainer measurement).
- Which training forward is recorded for the diagnostics is the step plan's decision
  (``policy/routing/plan.py``): ``update(..., record=True)`` is asked only of a strategy that routes
  freely in training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.policy.routing.recorder import Recording, Routing, RoutingRecorder
from gspo_megatron.policy.routing.replay import REPLAY_MODES, ReplayMode

TargetsOf = Callable[[MicroBatch], list[torch.Tensor]]  # a micro-batch -> the engine's experts per MoE layer
Pass = AbstractContextManager[Recording]


def needs_engine_routing(mode: str) -> bool:
    """Whether the rollout engine must return its routed experts for this mode (R3)."""
    return _strategy_class(mode).uses_engine_routing


def needs_trainer_old_pass(mode: str) -> bool:
    """Whether training replays what the trainer's old-log-prob forward recorded (R2): that forward
    must run, so pi_old cannot come from the engine (``trainer.old_log_probs=rollout``)."""
    return _strategy_class(mode).replays_old_pass


def replays(mode: str) -> bool:
    """Whether training forwards replay a routing (R2 or R3) instead of routing freely."""
    return _strategy_class(mode).replays_in_training


class ReplayStrategy:
    """``routing.replay=none``: routers choose freely; the old pass only records (for diagnostics)."""

    name = ReplayMode.none
    replays_in_training = False
    uses_engine_routing = False
    replays_old_pass = False

    def __init__(self, recorder: RoutingRecorder, targets_of: TargetsOf):
        self.recorder = recorder
        self.targets_of = targets_of

    # --- the old-log-prob pass -------------------------------------------------------------
    def old_pass(self, micro_batches: Sequence[MicroBatch]) -> Pass:
        return self.recorder.record()

    def old_policy_routing(self, old_pass: Recording) -> Routing | None:
        """What R2 replays and the "update" volatility compares against (None: nothing recorded)."""
        return old_pass.routing

    # --- each training forward -------------------------------------------------------------
    def update(self, micro_batches: Sequence[MicroBatch], old_routing: Callable[[], Routing], *, record: bool) -> Pass:
        """This mini-batch's forward; ``old_routing()`` gives the old pass's routing of exactly these
        micro-batches (asked for only by R2); ``record``: the diagnostics want its free routing."""
        return self.recorder.record() if record else self.recorder.route_freely()


class OldPolicyReplay(ReplayStrategy):
    """``routing.replay=old_policy`` (R2): training forwards replay the old pass's recorded experts."""

    name = ReplayMode.old_policy
    replays_in_training = True
    replays_old_pass = True

    def update(self, micro_batches: Sequence[MicroBatch], old_routing: Callable[[], Routing], *, record: bool) -> Pass:
        return self.recorder.replay(old_routing()) if self.recorder.has_routers else self.recorder.route_freely()


class RolloutReplay(ReplayStrategy):
    """``routing.replay=rollout`` (R3): every forward replays the engine's experts; the old pass is
    observed, so engine-vs-trainer routing is measured in the replaying forward (0 when it works)."""

    name = ReplayMode.rollout
    replays_in_training = True
    uses_engine_routing = True

    def old_pass(self, micro_batches: Sequence[MicroBatch]) -> Pass:
        return self._engine_routing(micro_batches, observe=True)

    def old_policy_routing(self, old_pass: Recording) -> Routing | None:
        return None  # the old pass replayed the engine's routing: nothing of the trainer's to replay

    def update(self, micro_batches: Sequence[MicroBatch], old_routing: Callable[[], Routing], *, record: bool) -> Pass:
        return self._engine_routing(micro_batches, observe=False)

    def _engine_routing(self, micro_batches: Sequence[MicroBatch], *, observe: bool) -> Pass:
        if not self.recorder.has_routers:
            return self.recorder.route_freely()
        return self.recorder.replay([self.targets_of(mb) for mb in micro_batches], observe=observe)


_STRATEGIES: dict[str, type[ReplayStrategy]] = {
    cls.name: cls for cls in (ReplayStrategy, OldPolicyReplay, RolloutReplay)
}
if tuple(_STRATEGIES) != REPLAY_MODES:
    raise ImportError(
        f"one replay strategy per mode of policy/routing/replay.py: {tuple(_STRATEGIES)} != {REPLAY_MODES}"
    )


def _strategy_class(mode: str) -> type[ReplayStrategy]:
    if mode not in _STRATEGIES:
        raise ValueError(f"routing.replay={mode!r} is unknown; valid: {', '.join(REPLAY_MODES)}")
    return _STRATEGIES[mode]


def build_replay_strategy(mode: str, recorder: RoutingRecorder, targets_of: TargetsOf) -> ReplayStrategy:
    return _strategy_class(mode)(recorder, targets_of)
