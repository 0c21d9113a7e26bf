"""SIGTERM / SIGINT: finish the current step, save, stop what the run started, exit non-zero.

Design decisions:
- Schedulers send SIGTERM some time before SIGKILL. The first signal only sets a flag; the trainer
  looks at it between steps, so a step (and a checkpoint being written) is never cut in half. Ranks
  agree through one all-reduce per step (a signal may reach only some ranks), then save together
  (``checkpoint.save_on_signal``) and raise ``TrainingInterrupted``.
- A second signal abandons the step at once (``TrainingInterrupted`` raised from the handler): the
  user asked twice.
- The first signal's wait is bounded: a step that does not reach its end within ``checkpoint.signal_grace_s``
  (a weight sync to a server that never answers, a stuck reward) is abandoned as by a second signal --
  ``TrainingInterrupted`` raised from a SIGALRM handler (``setitimer``), which interrupts blocking socket
  reads and lock waits in the main thread. The last checkpoint is kept as it is. The timer is disarmed when
  the step ends (``agreed_signal``), so the save on signal is not cut short by it.
- A Python handler runs only when the main thread is back in Python: a wait inside C++ (a gloo or NCCL
  collective of a distributed weight sync, up to ``rollout.sglang.weight_sync_timeout_s``) delays it --
  the handler of a signal that arrives during such a wait does not run at all until the wait ends. So a
  stop is also bounded from outside the main thread: Python's C-level handler writes each signal's number
  to a wakeup fd (``signal.set_wakeup_fd``) at once, a watcher thread reads it and arms a timer, and
  ``UNWIND_S`` after the grace (``UNWIND_S`` after a second signal) the timer ends the process with
  ``os._exit(128 + signal)`` and a line saying so -- clean-up calls to a stuck server included. A step
  that ends in time disarms it (``agreed_signal``). Nothing is lost that a soft stop would keep: the last checkpoint was
  written before (writes are atomic), the run directory's lock is stale once the process is gone (the
  next run takes it over), and the per-rank
  watchdog (``run/reaper.py``) stops the processes the run started.
- Either way the entry point's ``finally`` stops reward workers and the rollout
  engine (which stops the servers it launched) and releases the run directory.
- Exit status 128 + signal number (143 for SIGTERM, 130 for SIGINT), as a shell reports a process
  killed by that signal, with one line saying why and what was saved.
- Handlers are installed only in the main thread (Python's rule) and the previous ones restored.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from gspo_megatron.loop.trainer import TrainingInterrupted

WATCHED = (signal.SIGTERM, signal.SIGINT)
UNWIND_S = 30.0  # after the grace (or a second signal) the process has this long to unwind, then it exits


class SignalWatch:
    """Context manager: records the first SIGTERM/SIGINT; a second one interrupts immediately."""

    def __init__(self, grace_s: float, unwind_s: float = UNWIND_S) -> None:
        """``grace_s``: how long the current step may run after the first signal before it is abandoned;
        ``unwind_s``: how long the process may take to stop after that (or after a second signal)."""
        self.signum: int | None = None
        self.grace_s = grace_s
        self.unwind_s = unwind_s
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._hard_stop: threading.Timer | None = None
        self._lock = threading.Lock()  # the hard stop's state, shared by the main and the watcher thread
        self._handled = 0  # signals the main thread's handler has seen
        self._settled = 0  # of those, the ones whose step has ended (agreed_signal): no hard stop for them
        self._closed = False
        self._last_signal: int = signal.SIGTERM  # the watcher's latest, for the hard stop's exit status
        self._wakeup: tuple[socket.socket, socket.socket, int] | None = None  # reader, writer, previous fd

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is threading.main_thread():
            for signum in (*WATCHED, signal.SIGALRM):
                handler = self._grace_over if signum == signal.SIGALRM else self._handle
                self._previous[signum] = signal.signal(signum, handler)
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer, previous)
            threading.Thread(target=self._watch, args=(reader,), name="gspo-signal-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._closed = True
        self._disarm()
        if self._wakeup is not None:
            reader, writer, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            writer.close()
            reader.shutdown(socket.SHUT_RDWR)  # the watcher's recv returns
            reader.close()
            self._wakeup = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        with self._lock:
            self._handled += 1
        if self.signum is not None:
            raise TrainingInterrupted(signum, f"{name} received twice: abandoned the current step")
        self.signum = signum
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)  # SIGALRM -> _grace_over unless the step ends first
        print(
            f"[gspo] {name} received: finishing the current step (at most {self.grace_s:g} s, "
            f"checkpoint.signal_grace_s), then saving and stopping (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def _grace_over(self, _signum: int, _frame: FrameType | None) -> None:
        assert self.signum is not None, "the grace timer is armed by the first signal only"
        name = signal.Signals(self.signum).name
        raise TrainingInterrupted(
            self.signum,
            f"{name}: the current step did not end within checkpoint.signal_grace_s={self.grace_s:g} s; "
            f"abandoned it (the last checkpoint is kept as it was)",
        )

    def agreed_signal(self) -> int:
        """Collective over all ranks: the signal any rank received (0 if none). Called between steps: the step
        ended, so the grace timer is disarmed (the save that follows is not cut short)."""
        if self.signum is not None:
            with self._lock:
                self._settled = self._handled
            self._disarm()
        flag = torch.tensor([self.signum or 0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _watch(self, reader: socket.socket) -> None:
        """The watcher thread: each watched signal's number, as Python's C-level handler writes it to the wakeup
        fd, arms the hard stop -- the first at grace + unwind, a later one at unwind -- unless its step ended."""
        seen = 0
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for number in data:
                if number not in WATCHED:
                    continue
                seen += 1
                with self._lock:
                    if self._closed or seen <= self._settled:
                        continue
                    self._last_signal = number
                    self._arm_hard_stop(self.grace_s + self.unwind_s if seen == self._settled + 1 else self.unwind_s)

    def _arm_hard_stop(self, after_s: float) -> None:
        """``os._exit(128 + signal)`` in ``after_s`` seconds unless disarmed (the step ended, or the watch
        was left): the bound that holds while the main thread cannot run a Python handler."""
        if self._hard_stop is not None:
            self._hard_stop.cancel()
        self._hard_stop = threading.Timer(after_s, self._exit_now, args=(after_s,))
        self._hard_stop.daemon = True
        self._hard_stop.start()

    def _exit_now(self, after_s: float) -> None:
        signum = self.signum or self._last_signal
        print(
            f"[gspo] {signal.Signals(signum).name}: the run had not stopped {after_s:g} s later (a wait Python "
            f"cannot interrupt, e.g. a collective of a weight sync); exiting now with {128 + signum}; the last "
            f"checkpoint is kept as it was",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)

    def _disarm(self) -> None:
        if self._previous:  # the grace timer is armed only where the handlers were installed
            signal.setitimer(signal.ITIMER_REAL, 0)
        with self._lock:
            if self._hard_stop is not None:
                self._hard_stop.cancel()
                self._hard_stop = None
