"""``RoutingRecorder``: the one owner of every start and stop of a routing recording or replay.

A forward of the policy routes in one of three ways; each is a context manager around the forward
that yields a ``Recording`` (what to call before each micro-batch's forward, and afterwards what
megatron's routers chose, per micro-batch and MoE layer):

    record()                  routers choose freely; their top-k indices are recorded
    replay(targets)           routers use ``targets`` (one list per micro-batch); every target must
                              be consumed by exactly one forward
    replay(targets, observe)  as replay, and the indices top-k actually returned are recorded
    route_freely()            nothing is recorded or replayed

Design decisions:
- Who decides *which* forward records or replays is the routing plan and the replay strategy
  (``policy/routing/plan.py``, ``policy/routing/replay_strategy.py``, both behind ``policy/routing/step_routing.py``);
  this object only makes sure a recording always ends: the routers are reset on exit, also when the
  forward raised, so a failed pass cannot leave a replay armed for the next one.
- Without MoE layers there is no ``RoutingReplay``: every context yields an empty recording.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from gspo_megatron.policy.models.schedule import BeforeForward
from gspo_megatron.policy.routing.replay import RoutingReplay

Routing = list[list[torch.Tensor]]  # [micro_batch][moe_layer] -> int [tokens, k]


@dataclass
class Recording:
    """One pass's routing: ``before_forward`` for the schedule; ``routing`` filled on exit, and for a
    ``record()`` pass ``margins``: each token's top-k margin, [micro_batch][moe_layer] -> float [tokens]."""

    before_forward: BeforeForward | None = None
    routing: Routing = field(default_factory=list)
    margins: list[list[torch.Tensor]] = field(default_factory=list)


class RoutingRecorder:
    def __init__(self, replay: RoutingReplay | None):
        self._replay = replay

    @property
    def has_routers(self) -> bool:
        """Whether the model has MoE routers (else every recording is empty)."""
        return self._replay is not None

    @contextmanager
    def record(self) -> Iterator[Recording]:
        recording = Recording()
        if self._replay is None:
            yield recording
            return
        self._replay.start_recording()
        try:
            yield recording
            recording.routing = self._replay.recorded()
            recording.margins = self._replay.recorded_margins()
        finally:
            self._replay.stop()

    @contextmanager
    def replay(self, targets: Routing, *, observe: bool = False) -> Iterator[Recording]:
        if self._replay is None:
            yield Recording()
            return
        self._replay.load_targets(targets, observe=observe)
        recording = Recording(before_forward=self._replay.before_forward)
        try:
            yield recording
            self._replay.assert_fully_consumed()
            if observe:
                recording.routing = self._replay.recorded()
        finally:
            self._replay.stop()

    @contextmanager
    def route_freely(self) -> Iterator[Recording]:
        yield Recording()
