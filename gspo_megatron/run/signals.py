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
  collective of a distributed weight sync, up to ``rollout.sglang.weight_sync_timeout_s``) delays it. So
  a stop is also bounded from outside Python: ``UNWIND_S`` after the grace ran out, or after a second
  signal, a timer thread ends the process with ``os._exit(128 + signal)`` and a line saying so -- clean-up
  calls to a stuck server included. Nothing is lost that a soft stop would keep: the last checkpoint was
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

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is threading.main_thread():
            for signum in (*WATCHED, signal.SIGALRM):
                handler = self._grace_over if signum == signal.SIGALRM else self._handle
                self._previous[signum] = signal.signal(signum, handler)
        return self

    def __exit__(self, *exc: object) -> None:
        self._disarm()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            self._arm_hard_stop(self.unwind_s)
            raise TrainingInterrupted(signum, f"{name} received twice: abandoned the current step")
        self.signum = signum
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)  # SIGALRM -> _grace_over unless the step ends first
        self._arm_hard_stop(self.grace_s + self.unwind_s)  # in case the main thread waits inside C++ meanwhile
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
            self._disarm()
        flag = torch.tensor([self.signum or 0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _arm_hard_stop(self, after_s: float) -> None:
        """``os._exit(128 + signal)`` in ``after_s`` seconds unless disarmed (the step ended, or the watch
        was left): the bound that holds while the main thread cannot run a Python handler."""
        if self._hard_stop is not None:
            self._hard_stop.cancel()
        self._hard_stop = threading.Timer(after_s, self._exit_now, args=(after_s,))
        self._hard_stop.daemon = True
        self._hard_stop.start()

    def _exit_now(self, after_s: float) -> None:
        signum = self.signum or signal.SIGTERM
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
        if self._hard_stop is not None:
            self._hard_stop.cancel()
            self._hard_stop = None
