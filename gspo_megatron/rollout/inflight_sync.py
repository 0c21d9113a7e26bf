"""A weight sync that lands inside the streaming producer's round: the trainer's stream goes to the embedded
engine's ``request_update`` (``rollout/embedded/inflight.py``), handed over one tensor at a time; or, to SGLang's
servers, through their own pause in that mode (``SGLangEngine.update_weights_in_flight``: ``/pause_generation``,
the update, ``/continue_generation`` while the producer's requests wait on the servers).

    ticket = engine.request_update(hand_off, version, mode)   # the decode loop takes it at a step boundary
    hand_off.feed(ticket)                                     # the trainer's thread reads the stream into it
    ticket.wait(bound)

Design decisions:
- The stream is read on the trainer's thread, never the generating one: reading it is the policy's export
  (``loop/weight_sync.py``), collective on every rank, and the trainer's thread is where those collectives
  run. The engine's thread takes what the trainer reads through a one-tensor slot, so nobody holds more than
  one tensor beyond the export's own (the bounded-memory rule of ``loop/weight_sync.py``).
- No generation running, the mailbox applies the update at once in the caller's thread, which is the
  trainer's: the hand-off then reads the stream there directly (``HandOff.__iter__``), no slot.
- SGLang needs no hand-off: its servers pause their running requests themselves, so the trainer's thread
  sends the update as a sync between rounds does, and the producer's requests simply take longer.
- Bounds: every wait (the engine for the next tensor, the trainer for the slot to empty, the ticket) lasts at
  most ``wait_bound_s``. An update that fails in the generating thread stops taking tensors: the trainer sees
  the ticket done and stops feeding (the export pass left half-read is drained by the stream's owner), and
  ``ticket.wait`` raises that error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

from gspo_megatron.core.named_tensors import NamedTensor
from gspo_megatron.rollout.config import InflightUpdateMode

_END = object()  # the slot's last item: the stream is read to its end
_POLL_S = 0.5  # how often a feeder blocked on a full slot looks whether the update failed in the other thread


class UpdateTicketLike(Protocol):
    @property
    def done(self) -> bool: ...

    def wait(self, timeout_s: float) -> None: ...


@runtime_checkable
class InflightEngine(Protocol):
    """An engine that takes a weight version inside a running generation (``EmbeddedEngine``)."""

    def request_update(self, named_tensors: Iterable[NamedTensor], version: int, mode: str) -> UpdateTicketLike: ...


@runtime_checkable
class PausingEngine(Protocol):
    """An engine whose servers pause their running requests for an update (``SGLangEngine``)."""

    def update_weights_in_flight(self, named_tensors: Iterable[NamedTensor], version: int, mode: str) -> None: ...


class HandOff:
    """The trainer's stream as the engine reads it: directly in the trainer's thread, else through one slot."""

    def __init__(self, stream: Iterable[NamedTensor], wait_bound_s: float):
        self._stream = stream
        self.wait_bound_s = wait_bound_s
        self._feeder = threading.get_ident()
        self._slot: list[object] = []
        self._condition = threading.Condition()
        self.read_directly = False

    def __iter__(self) -> Iterator[NamedTensor]:
        if threading.get_ident() == self._feeder:  # applied at once: no generation was running
            self.read_directly = True
            return iter(self._stream)
        return self._taken()

    def _taken(self) -> Iterator[NamedTensor]:
        while True:
            with self._condition:
                if not self._condition.wait_for(lambda: bool(self._slot), self.wait_bound_s):
                    raise TimeoutError(f"the trainer handed no weight tensor within {self.wait_bound_s} s")
                item = self._slot.pop()
                self._condition.notify_all()
            if item is _END:
                return
            yield item  # type: ignore[misc]

    def feed(self, ticket: UpdateTicketLike) -> None:
        """Read the stream into the slot until its end, or until the update is done (failed) in the other
        thread; nothing to do when it was read directly."""
        if self.read_directly:
            return
        for item in self._stream:
            if not self._put(item, ticket):
                return
        self._put(_END, ticket)

    def _put(self, item: object, ticket: UpdateTicketLike) -> bool:
        """Bounded: False once ``ticket`` is done (the engine takes no more); ``TimeoutError`` past the bound."""
        deadline = time.monotonic() + self.wait_bound_s
        with self._condition:
            while self._slot:
                if ticket.done:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"the engine took no weight tensor within {self.wait_bound_s} s (no decode step boundary "
                        "came, or the generation is stuck)"
                    )
                self._condition.wait(min(_POLL_S, left))
            self._slot.append(item)
            self._condition.notify_all()
        return True


def load_in_flight(
    engine: object,
    named_tensors: Iterable[NamedTensor],
    version: int,
    mode: InflightUpdateMode,
    wait_bound_s: float,
) -> None:
    """Land ``version`` in the engine's running generation (or at once, none running); returns once applied."""
    if isinstance(engine, PausingEngine):
        engine.update_weights_in_flight(named_tensors, version, str(mode))
        return
    if not isinstance(engine, InflightEngine):
        raise TypeError(
            f"rollout.inflight_update_mode={mode}: the engine {type(engine).__name__} takes no in-flight update; "
            "set rollout.engine=embedded or sglang, or rollout.inflight_update_mode=off"
        )
    hand_off = HandOff(named_tensors, wait_bound_s)
    ticket = engine.request_update(hand_off, version, str(mode))
    try:
        hand_off.feed(ticket)
    finally:
        ticket.wait(wait_bound_s)  # raises the generating thread's error, or withdraws an update never taken
