"""The in-process reward path (``reward.in_process``), bounded by the pooled path's ``reward.timeout_s``.

    caller = InProcessCaller(score_one, warm_up, "import:my.module:fn", config)
    results = caller.score_all(responses, records)   # score_one's results; past the timeout a ``timeout`` failure

Design decisions:
- A call in the trainer's process cannot be killed, so it runs in a daemon thread the caller waits for at
  most ``reward.timeout_s``. Past it, the sample is a ``timeout`` failure (reward 0, counted like a
  worker's timeout), the thread is abandoned -- it runs on until the reward returns, and what it returns
  is dropped -- and a warning says so, with the count of threads abandoned. The next call gets a fresh
  thread. Before this a reward that never returned held the run with no output.
- One long-lived thread, not one per call: the trivial built-ins (the default in-process rewards) take
  microseconds, and a queue hand-off costs less than a thread start. Measured (``exact_match``, 20k
  calls, a loaded 2-core machine): 16 us a call made directly, 70 us through the thread when each call
  was its own hand-off.
- A batch is ONE hand-off (``score_all``): the thread runs its calls back to back, noting when each
  starts, and the caller sleeps until the whole batch is done or the running call is past
  ``reward.timeout_s`` from ITS start (``_Batch``). A hand-off per call cost two thread wake-ups per
  sample, and a woken caller waits for the GIL while the thread runs the next call (up to the 5 ms
  switch interval): 8-17 ms for the main job's 256 samples on a shared 2-core machine, about 1.5 ms as
  one batch (``tools/bench_rl_step.py``'s ``reward`` phase).
- A thread abandoned mid-batch (a timeout, or an exception out of the caller) runs none of the batch's
  later calls (``stop`` is checked before each): the rest go to a fresh thread, so no call runs twice
  and no stale outcome reaches a later batch.
- ``warm_up`` (a slow import, e.g. sympy for math-verify) runs in the thread once, bounded by
  ``reward.startup_timeout_s``, before the first sample: as in a worker, it never eats a sample's budget.
- What no thread can bound: a reward that holds the GIL without end (a C extension's loop) stalls the
  caller too; ``reward.in_process=false`` runs it in a worker process, which is killed at the timeout.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.rewards.config import RewardConfig
from gspo_megatron.rollout.rewards.types import RewardResult


@dataclass
class _Batch:
    """A batch of calls and its progress, written by the serving thread: each call's outcome in order, the
    (index, monotonic start) of the call running now, and ``done`` once every call has its outcome."""

    calls: Sequence[Callable[[], Any]]
    outcomes: list[tuple[Any, BaseException | None]] = field(default_factory=list)
    running: tuple[int, float] = (0, 0.0)
    done: threading.Event = field(default_factory=threading.Event)

    def overdue(self, timeout_s: float) -> int | None:
        """The index of the running call when it has run ``timeout_s`` or longer without an outcome."""
        index, started = self.running  # one read: the thread replaces the pair before each call
        if len(self.outcomes) <= index < len(self.calls) and time.monotonic() - started >= timeout_s:
            return index
        return None


class _CallThread:
    """A daemon thread that runs the batches handed to it, each call in turn; once ``stop`` is called it
    starts no further call."""

    def __init__(self, name: str):
        self.inbox: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while (batch := self.inbox.get()) is not None:  # idle until work comes or ``stop``
            for index, work in enumerate(batch.calls):
                if self._stopped.is_set():  # abandoned: the caller gave this batch's rest to a fresh thread
                    return
                batch.running = (index, time.monotonic())
                try:
                    batch.outcomes.append((work(), None))
                except BaseException as error:  # noqa: BLE001 - handed to the caller, who re-raises it
                    batch.outcomes.append((None, error))
            batch.done.set()

    def run(self, calls: Sequence[Callable[[], Any]], timeout_s: float) -> tuple[list[Any], int | None]:
        """The calls' values in order, up to the first that ran past ``timeout_s`` (its index, else None);
        a call's exception is raised. The caller sleeps until the batch is done or the running call is due."""
        batch = _Batch(calls, running=(0, time.monotonic()))
        self.inbox.put(batch)
        overdue = None
        while overdue is None:
            _, started = batch.running
            if batch.done.wait(max(0.0, started + timeout_s - time.monotonic())):
                break
            overdue = batch.overdue(timeout_s)
        outcomes = batch.outcomes[: len(calls) if overdue is None else overdue]
        for _, error in outcomes:
            if error is not None:
                raise error
        return [value for value, _ in outcomes], overdue

    def stop(self) -> None:
        self._stopped.set()
        self.inbox.put(None)  # an abandoned thread reads it once its call returns


class InProcessCaller:
    """Calls one reward function in the trainer's process with a timeout (see the module docstring)."""

    def __init__(
        self,
        score_one: Callable[[str, PromptRecord], RewardResult],
        warm_up: Callable[[], object] | None,
        reward_name: str,
        config: RewardConfig,
    ):
        self._score_one, self.reward_name, self.config = score_one, reward_name, config
        self.abandoned = 0  # threads left running a call past reward.timeout_s
        self.handoffs = 0  # batches handed to a thread: one per ``score_all``, plus one after each timeout
        self._thread: _CallThread | None = None
        if warm_up is not None:
            self._warm_up(warm_up)

    def _worker(self) -> _CallThread:
        if self._thread is None:
            self._thread = _CallThread(f"reward-in-process-{self.abandoned}")
        return self._thread

    def _warm_up(self, warm_up: Callable[[], object]) -> None:
        try:
            _, overdue = self._worker().run([warm_up], self.config.startup_timeout_s)
            if overdue is not None:
                raise TimeoutError
        except TimeoutError:
            raise RuntimeError(
                f"reward {self.reward_name!r}: warm_up did not return within reward.startup_timeout_s="
                f"{self.config.startup_timeout_s:g} s in the trainer process; raise it, or set reward.in_process=false"
            ) from None
        except Exception as error:
            raise RuntimeError(f"reward {self.reward_name!r} cannot start: warm_up raised {error!r}") from error

    def score_all(self, responses: Sequence[str], records: Sequence[PromptRecord]) -> list[RewardResult]:
        """Each response's result, in order: the batch in one hand-off to the thread; a call past
        ``reward.timeout_s`` is a ``timeout`` failure and the calls after it go to a fresh thread."""
        results: list[RewardResult] = []
        while len(results) < len(responses):
            results += self._score_until_timeout(responses[len(results) :], records[len(results) :])
        return results

    def _score_until_timeout(self, responses: Sequence[str], records: Sequence[PromptRecord]) -> list[RewardResult]:
        """The results of ``responses`` in order, up to and including the first that timed out."""
        timeout_s = self.config.timeout_s
        self.handoffs += 1
        calls = [functools.partial(self._score_one, r, rec) for r, rec in zip(responses, records, strict=True)]
        try:
            results, overdue = self._worker().run(calls, timeout_s)
        except BaseException:
            self._abandon(warn=False)  # a call raised past call_reward's guard: a fresh thread serves on
            raise
        if overdue is None:
            return results
        self._abandon()
        return [*results, RewardResult.failed(f"verifier timed out after {timeout_s} s (reward.timeout_s)", "timeout")]

    def _abandon(self, warn: bool = True) -> None:
        assert self._thread is not None
        self._thread.stop()
        self._thread = None
        self.abandoned += 1
        if not warn:
            return
        warnings.warn(
            f"reward {self.reward_name!r} did not return within reward.timeout_s={self.config.timeout_s:g} s in the "
            f"trainer process (reward.in_process): the sample scores 0 as a timeout, and the call's thread is "
            f"abandoned -- a thread cannot be killed, it runs on ({self.abandoned} abandoned so far). "
            "reward.in_process=false runs the reward in worker processes, which are killed at the timeout",
            RuntimeWarning,
            stacklevel=3,
        )

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
