"""``RunInterrupted``: the run was told to stop (a signal); the work under way is abandoned, not retried.

Design decisions:
- A second SIGTERM/SIGINT raises ``loop.trainer.TrainingInterrupted`` (a ``RunInterrupted``) from the
  signal handler, wherever the main thread is -- inside a weight sync on the rollout side too. Code that
  handles its own failures must not take the stop for one of them: no fallback, no retry, no wrapping
  (a weight sync wrapped the stop in ``WeightSyncError``, and the run exited 1, not 143). The rollout
  side cannot import ``loop``, so the type both sides know lives here, below both.
"""

from __future__ import annotations


class RunInterrupted(Exception):
    """The run stops on a signal; the process exits 128 + the signal's number."""

    def __init__(self, signum: int, reason: str):
        super().__init__(reason)
        self.signum = signum
        self.exit_code = 128 + signum
