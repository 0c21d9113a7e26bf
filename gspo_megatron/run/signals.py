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
- Either way the entry point's ``finally`` stops reward workers and the rollout
  engine (which stops the servers it launched) and releases the run directory.
- Exit status 128 + signal number (143 for SIGTERM, 130 for SIGINT), as a shell reports a process
  killed by that signal, with one line saying why and what was saved.
- Handlers are installed only in the main thread (Python's rule) and the previous ones restored.
"""

from __future__ import annotations

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


class SignalWatch:
    """Context manager: records the first SIGTERM/SIGINT; a second one interrupts immediately."""

    def __init__(self, grace_s: float) -> None:
        """``grace_s``: how long the current step may run after the first signal before it is abandoned."""
        self.signum: int | None = None
        self.grace_s = grace_s
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is threading.main_thread():
            for signum in (*WATCHED, signal.SIGALRM):
                handler = self._grace_over if signum == signal.SIGALRM else self._handle
                self._previous[signum] = signal.signal(signum, handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
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
        if self.signum is not None and self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
        flag = torch.tensor([self.signum or 0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
