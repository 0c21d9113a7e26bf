"""Routing Replay as one strategy object per mode: the trainer and the diagnostics call its hooks and
never branch on ``algorithm.routing_replay`` themselves.

A step runs the old-log-prob pass, then one training forward per mini-batch (see trainer/trainer.py):

    mode        old-log-prob pass                         each training forward
    none        record the routing (diagnostics only)     route freely
    old_policy  RECORD the routing (R2)                   REPLAY what the old pass recorded
    rollout     REPLAY the engine's experts, observed     REPLAY the engine's experts (R3)

Design decisions:
- The strategies drive ``routing/replay.py``'s ``RoutingReplay`` (megatron's ``RouterReplay``
  instances of one model); without MoE layers there is no ``RoutingReplay`` and every hook is a no-op.
- ``old_pass_end`` returns what the pass recorded: the routing R2 replays and the diagnostics compare
  against (``old_policy_routing``; None under R3, where the pass itself replays) and the routing the
  trainer actually used (``trainer_routing``, for the engine-vs-trainer measurement).
- The strategies own no state of megatron's: ``RoutingReplay.restore`` (called by
  ``Components.close``) gives megatron's instances back the attributes it patched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gspo_megatron.models.micro_batch import MicroBatch
from gspo_megatron.routing.replay import REPLAY_MODES, RoutingReplay

Routing = list[list[torch.Tensor]]  # [micro_batch][moe_layer] -> int [tokens, k]
TargetsOf = Callable[[MicroBatch], list[torch.Tensor]]  # a micro-batch -> the engine's experts per MoE layer
BeforeForward = Callable[[], None]


def needs_engine_routing(mode: str) -> bool:
    """Whether the rollout engine must return its routed experts for this mode (R3)."""
    return _strategy_class(mode).uses_engine_routing


def needs_trainer_old_pass(mode: str) -> bool:
    """Whether training replays what the trainer's old-log-prob forward recorded (R2): that forward
    must run, so pi_old cannot come from the engine (``algorithm.old_log_probs=rollout``)."""
    return _strategy_class(mode).replays_old_pass


def replays(mode: str) -> bool:
    """Whether training forwards replay a routing (R2 or R3) instead of routing freely."""
    return _strategy_class(mode).replays_in_training


@dataclass
class OldPassRouting:
    old_policy_routing: Routing | None  # what R2 replays and "update" volatility compares against
    trainer_routing: Routing  # what the trainer routed with in the old pass (empty without MoE)


class ReplayStrategy:
    """``routing_replay=none``: routers choose freely; the old pass only records (for diagnostics)."""

    name = "none"
    replays_in_training = False
    uses_engine_routing = False
    replays_old_pass = False

    def __init__(self, replay: RoutingReplay | None, targets_of: TargetsOf):
        self.replay = replay
        self.targets_of = targets_of

    # --- the old-log-prob pass -------------------------------------------------------------
    def old_pass_begin(self, micro_batches: list[MicroBatch]) -> BeforeForward | None:
        if self.replay is not None:
            self.replay.start_recording()
        return None

    def old_pass_end(self) -> OldPassRouting:
        if self.replay is None:
            return OldPassRouting(None, [])
        recorded = self.replay.recorded()
        self.replay.stop()
        return OldPassRouting(recorded, recorded)

    # --- each training forward -------------------------------------------------------------
    def update_begin(self, micro_batches: list[MicroBatch], old_routing: Callable[[], Routing]) -> BeforeForward | None:
        """Queue this mini-batch's replay targets; ``old_routing()`` gives the old pass's routing of
        exactly these micro-batches (asked for only by R2)."""
        return None

    def update_end(self) -> None:
        if self.replay is not None:
            self.replay.assert_fully_consumed()
            self.replay.stop()


class OldPolicyReplay(ReplayStrategy):
    """``routing_replay=old_policy`` (R2): training forwards replay the old pass's recorded experts."""

    name = "old_policy"
    replays_in_training = True
    replays_old_pass = True

    def update_begin(self, micro_batches: list[MicroBatch], old_routing: Callable[[], Routing]) -> BeforeForward | None:
        if self.replay is None:
            return None
        self.replay.load_targets(old_routing())
        return self.replay.before_forward


class RolloutReplay(ReplayStrategy):
    """``routing_replay=rollout`` (R3): every forward replays the engine's experts; the old pass is
    observed, so engine-vs-trainer routing is measured in the replaying forward (0 when it works)."""

    name = "rollout"
    replays_in_training = True
    uses_engine_routing = True

    def old_pass_begin(self, micro_batches: list[MicroBatch]) -> BeforeForward | None:
        if self.replay is None:
            return None
        self.replay.load_targets([self.targets_of(mb) for mb in micro_batches], observe=True)
        return self.replay.before_forward

    def old_pass_end(self) -> OldPassRouting:
        if self.replay is None:
            return OldPassRouting(None, [])
        self.replay.assert_fully_consumed()
        recorded = self.replay.recorded()
        self.replay.stop()
        return OldPassRouting(None, recorded)

    def update_begin(self, micro_batches: list[MicroBatch], old_routing: Callable[[], Routing]) -> BeforeForward | None:
        if self.replay is None:
            return None
        self.replay.load_targets([self.targets_of(mb) for mb in micro_batches])
        return self.replay.before_forward


_STRATEGIES: dict[str, type[ReplayStrategy]] = {
    cls.name: cls for cls in (ReplayStrategy, OldPolicyReplay, RolloutReplay)
}
if tuple(_STRATEGIES) != REPLAY_MODES:
    raise ImportError(f"one replay strategy per mode of routing/replay.py: {tuple(_STRATEGIES)} != {REPLAY_MODES}")


def _strategy_class(mode: str) -> type[ReplayStrategy]:
    if mode not in _STRATEGIES:
        raise ValueError(f"algorithm.routing_replay={mode!r} is unknown; valid: {', '.join(REPLAY_MODES)}")
    return _STRATEGIES[mode]


def build_replay_strategy(mode: str, replay: RoutingReplay | None, targets_of: TargetsOf) -> ReplayStrategy:
    return _strategy_class(mode)(replay, targets_of)
