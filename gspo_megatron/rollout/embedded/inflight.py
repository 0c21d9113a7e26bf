"""In-flight weight updates for the embedded engine: a new version lands between two decode steps of a
generation that runs in another thread, which then goes on under it.

    ticket = engine.request_update(named_tensors, version, "in_place")   # from the trainer's thread
    ticket.wait(timeout_s=60.0)   # returns once the decode loop applied it; TimeoutError withdraws it

Design decisions:
- One mailbox, at most one update pending: the trainer posts (``UpdateMailbox.request``) and the decode loop
  takes it at its next step boundary -- before a forward, never inside one -- and copies the tensors in its
  own thread (``EmbeddedEngine.update_weights``: the version moves after the last tensor). A second request
  while one is pending is refused, not queued: the trainer has one weight stream at a time.
- No generation running: the update is applied at once, in the caller's thread, under the mailbox's lock,
  which a generation call takes to start (``generating``), so none starts on half-copied weights. A call
  that ends with an update still pending (it finished before another step boundary) applies it as it ends.
- Bounds: ``UpdateTicket.wait(timeout_s)`` waits at most ``timeout_s`` for the loop to take the update; past
  it, an update not yet taken is withdrawn (the engine keeps its version) and ``TimeoutError`` says so. The
  lock is held only while one update's tensors are copied, so a wait that meets an update being applied
  waits for that copy, no longer. An update that fails in the generating thread (a bad name, a bad shape)
  fails that generation call and the ticket's wait alike, so neither side misses it.
- The stream is read in the generating thread when the update is taken: the caller keeps its tensors
  alive and unchanged until the ticket is done.
- What each mode does to the rows running, their log-probs and their routing rows is the decode loop's
  (``engine.py``, "In-flight weight updates"); a turn call (``generate_turns``) takes no update inside
  (a ``TurnResult`` has one version): an update requested during one lands as the call ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from gspo_megatron.rollout.config import InflightUpdateMode

# Sample.extra key: a row that returns routed experts and was ended at a ``retract`` update because the new
# weights route some of its positions otherwise (``engine.py``); the value is how many positions
RETRACT_REROUTED = "retract_rerouted_positions"


def inflight_update_mode(mode: str) -> InflightUpdateMode:
    """``mode`` as an ``InflightUpdateMode``; an unknown one (or ``off``: the config key's, no update) raises
    naming the valid ones."""
    valid = [m for m in InflightUpdateMode if m != InflightUpdateMode.off]
    if mode not in valid:
        raise ValueError(f"in-flight update mode {mode!r} is unknown; valid: {', '.join(valid)}")
    return InflightUpdateMode(mode)


@dataclass(frozen=True)
class InflightUpdate:
    """One weight version for a running generation."""

    named_tensors: Iterable[tuple[str, torch.Tensor]]  # HF-named, as ``EmbeddedEngine.update_weights`` takes
    version: int
    mode: InflightUpdateMode


class UpdateTicket:
    """The requester's handle on one posted update."""

    def __init__(self, mailbox: UpdateMailbox, update: InflightUpdate):
        self._mailbox = mailbox
        self.update = update
        self._done = threading.Event()
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> None:
        """Return once the update is applied; raise ``TimeoutError`` (withdrawing it) if the decode loop has not
        taken it within ``timeout_s``, or the error it failed with in the generating thread."""
        if not self._done.wait(timeout_s) and self._mailbox.withdraw(self):
            raise TimeoutError(
                f"the weight update to version {self.update.version} was not applied within {timeout_s} s (no "
                f"decode step boundary came: the generation is stuck or the wait too short); it is withdrawn, "
                f"the engine keeps its weights -- request it again or wait longer"
            )
        # not withdrawn: the loop took it, and withdraw() took the lock only after the copy ended
        if self._error is not None:
            raise RuntimeError(
                f"the weight update to version {self.update.version} failed in the generating thread: {self._error}"
            ) from self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


class UpdateMailbox:
    """The one pending update between a requesting thread and the generating one (module docstring)."""

    def __init__(self, load: Callable[[Iterable[tuple[str, torch.Tensor]], int], None]):
        self._load = load
        self._lock = threading.Lock()
        self._generating = 0  # generation calls running (a call may run another inside it)
        self._holding = 0  # of them, calls that take no update inside (turns)
        self._pending: UpdateTicket | None = None

    def request(self, update: InflightUpdate) -> UpdateTicket:
        ticket = UpdateTicket(self, update)
        with self._lock:
            if self._pending is not None:
                raise RuntimeError(
                    f"a weight update to version {self._pending.update.version} is still pending; wait for its "
                    f"ticket before requesting version {update.version}"
                )
            if self._generating:
                self._pending = ticket
            else:
                self._apply(ticket)
        return ticket

    @contextmanager
    def generating(self, takes_updates: bool = True) -> Iterator[None]:
        """Around a generation call: updates requested meanwhile wait for its step boundaries (none inside
        while a call with ``takes_updates=False`` runs), or its end."""
        with self._lock:
            self._generating += 1
            self._holding += not takes_updates
        try:
            yield
        finally:
            with self._lock:
                self._generating -= 1
                self._holding -= not takes_updates
                if not self._generating and self._pending is not None:
                    ticket, self._pending = self._pending, None
                    self._apply(ticket)

    def take(self) -> InflightUpdate | None:
        """At a step boundary of the decode loop: apply the pending update, if any, and return it."""
        with self._lock:
            if self._pending is None or self._holding:
                return None
            ticket, self._pending = self._pending, None
            self._apply(ticket)
            return ticket.update

    def withdraw(self, ticket: UpdateTicket) -> bool:
        """Take back ``ticket``'s update if the loop has not taken it; False if it has (it is applied by now)."""
        with self._lock:
            if self._pending is ticket:
                self._pending = None
                return True
            return False

    def _apply(self, ticket: UpdateTicket) -> None:  # under the lock
        try:
            self._load(ticket.update.named_tensors, ticket.update.version)
        except BaseException as error:
            ticket._finish(error)
            raise
        ticket._finish(None)
