"""Name the rank that went silent when a collective fails (issue 34, D6).

A gloo collective that times out says only ``Timed out waiting 600000ms for recv operation`` on the
ranks that waited, and nothing names the rank they waited for. Here every rank of a multi-rank run
runs a daemon thread that bumps a beat counter in the rendezvous store every ``interval_s``, and at
once when the rank enters a phase, with the step and phase the rank is in. A rank that catches a
failed collective reads every rank's beat twice, ``SILENCE_FACTOR`` intervals apart: a rank whose
counter did not move is stopped (SIGSTOP, a debugger), dead, or stuck holding the GIL, and the error
names it with the step and phase it was last seen in.

Design decisions:
- Counters, not clocks: the nodes' clocks need not agree.
- The thread has its own store client (to the store every rank met at: ``MASTER_ADDR:MASTER_PORT``,
  or this attempt's own under torchrun's restarts, ``attempt_store.py``), so it
  never shares a connection with the process group; its keys live under ``gspo_heartbeat/``.
- Collectives release the GIL while they wait, so a waiting rank keeps beating: only the silent one
  stops. A store that no longer answers (the job is ending) is ignored by the thread.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_INTERVAL_S = 1.0
SILENCE_FACTOR = 3.0  # a counter unchanged over this many intervals is silent
STORE_TIMEOUT_S = 10.0
PREFIX = "gspo_heartbeat/"


def is_collective_failure(error: BaseException) -> bool:
    """A gloo/NCCL collective that timed out, or whose peer closed the connection. gloo words a timeout
    two ways: "Timed out waiting ...ms for recv" (an unbound buffer's wait) and, when the timeout closes a
    pair with an operation pending on it, "Application timeout caused pair closure" (seen in CI: a
    sequence-parallel reduce-scatter of a stopped peer, so the stopped rank went unnamed)."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(marker in text for marker in COLLECTIVE_FAILURE_MARKERS)


COLLECTIVE_FAILURE_MARKERS = (
    "Timed out waiting",
    "Application timeout caused pair closure",
    "Connection closed by peer",
    "collective operation timeout",
)


class Heartbeat:
    """This rank's beat, published from a daemon thread; ``silent_ranks()`` finds the ones that stopped."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, interval_s: float = HEARTBEAT_INTERVAL_S):
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
        self._store = dist.PrefixStore(PREFIX, client)
        self.where = "start-up"
        self._beats = 0
        self._beaten = threading.Condition()
        self._stopped = threading.Event()
        self._wake = threading.Event()  # set by enter() and close(): beat now, not at the next interval
        self._thread = threading.Thread(target=self._beat, name="gspo-heartbeat", daemon=True)
        self._thread.start()

    def enter(self, where: str) -> None:
        """What this rank is doing now (e.g. ``step 3, update``); published at once, so a rank stopped a
        moment after entering a phase is reported in it, not in the phase the last periodic beat saw."""
        self.where = where
        self._wake.set()

    def _beat(self) -> None:
        while not self._stopped.is_set():
            self._wake.clear()  # before reading where: an enter() after this read beats again at once
            beat = self._beats + 1
            with contextlib.suppress(RuntimeError):  # the store is gone: the job is ending
                self._store.set(str(self.rank), f"{beat} {self.where}")
            with self._beaten:  # counted only once in the store: wait_for_beats then reads it there
                self._beats = beat
                self._beaten.notify_all()
            self._wake.wait(self.interval_s)

    def wait_for_beats(self, count: int, timeout_s: float = STORE_TIMEOUT_S) -> bool:
        """Block until this rank has published ``count`` beats (tests, and start-up checks)."""
        with self._beaten:
            return self._beaten.wait_for(lambda: self._beats >= count, timeout=timeout_s)

    def _read(self) -> dict[int, tuple[int, str]]:
        beats = {}
        for rank in range(self.world_size):
            if self._store.check([str(rank)]):
                count, _, where = self._store.get(str(rank)).decode().partition(" ")
                beats[rank] = (int(count), where)
        return beats

    def silent_ranks(self) -> dict[int, str]:
        """Ranks whose beat did not move over ``SILENCE_FACTOR`` intervals: rank -> where last seen."""
        try:
            before = self._read()
            self._stopped.wait(SILENCE_FACTOR * self.interval_s)
            after = self._read()
        except RuntimeError as error:
            return {-1: f"the rendezvous store did not answer ({error})"}
        return {
            rank: after.get(rank, (0, "never started"))[1]
            for rank in range(self.world_size)
            if rank != self.rank and before.get(rank, (0,))[0] == after.get(rank, (0,))[0]
        }

    def explain(self, error: BaseException, timeout_s: float) -> str:
        """One message for a failed collective: where this rank was, and which ranks are silent."""
        silent = self.silent_ranks()
        if silent.get(-1):
            who = silent[-1]
        elif silent:
            who = "silent: " + "; ".join(f"rank {r} (last seen in {where})" for r, where in sorted(silent.items()))
            who += " -- stopped, hung or dead; check that rank's log and process"
        else:
            who = (
                "every other rank is still beating: one is slow or stuck in its own work; "
                f"raise parallel.timeout_s (now {timeout_s:g}) if a phase legitimately takes longer"
            )
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        where = f"rank {self.rank}: a collective failed in {self.where} (parallel.timeout_s={timeout_s:g})"
        return f"{where}: {first_line}; {who}"

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=STORE_TIMEOUT_S)
