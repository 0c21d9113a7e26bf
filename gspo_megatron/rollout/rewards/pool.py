"""RewardPool: score a batch of responses with a per-call timeout, in worker processes.

Design decisions:
- Our own small worker set (one duplex pipe per process, one call in flight per worker) instead of
  ``concurrent.futures.ProcessPoolExecutor``: when one executor worker dies the executor breaks and
  every in-flight future fails, and a hung call cannot be cancelled. Here a hang or a crash costs
  exactly the one sample it happened on (reward 0, ``error`` set, counted in ``stats``); that worker
  is killed and replaced, and the rest of the batch carries on.
- The timeout clock starts when a call is handed to an idle, warmed-up worker; workers report ready
  only after importing the verifier and running its ``warm_up``, so a restart's import time never
  eats into a sample's budget.
- Workers start with ``forkserver`` (or ``spawn``), never ``fork``: the trainer holds threads and
  process groups that must not be duplicated. The fork server preloads this package, so replacing a
  worker takes milliseconds, not a fresh import of torch (which the shared Registry pulls in).
- Exceptions raised by the verifier are caught inside the worker (the worker lives on); the same
  guard runs on the in-process fast path, which is taken by default only for the built-ins registered
  as trivial (pure string checks); ``import:`` rewards and math-verify run in workers unless
  ``reward.in_process=true`` says otherwise. The in-process path has the same ``reward.timeout_s``: each
  call runs in a daemon thread, abandoned with a warning past it (``in_process.py``).
- Every failure costs its one sample (reward 0) and carries its kind (``FAILURE_KINDS``): raised,
  wrong type (checked inside the guard, conversion included), NaN/inf, timeout, death.
- A plain value is accepted as TRL's reward functions return it (``as_reward_result``): a bool ``b`` is
  ``RewardResult(float(b), correct=b, format_ok=True)``; a real number ``x`` (int, float, numpy scalar, or a
  one-element tensor/array) is ``RewardResult(float(x), correct=x > 0, format_ok=True)`` -- a positive score
  counts as correct, so a 1/0 or +1/-1 reward has the accuracy it means; a partial-credit reward that wants
  its own notion of correct returns a RewardResult. Anything else (a string, None, a dict) is ``bad_type``;
  NaN/inf is ``nonfinite`` as in a RewardResult.
- The fields are type-checked, not converted: ``bool("false")`` is True and ``float("1")`` is 1.0, so
  a verifier returning strings would score silently. ``correct``/``format_ok`` must be bools (or the
  integers 0/1, numpy's included), ``reward`` a real number; anything else is a ``bad_type`` failure.
- ``turn_rewards`` (a trajectory's per-turn rewards) must be a list or tuple of one real number per turn of
  ``record.trajectory``: a wrong count, a non-number, or per-turn rewards for a single response are
  ``bad_type``, a NaN/inf among them ``nonfinite``; the whole sample fails, as for its reward.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import numbers
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from gspo_megatron.core.threads import single_threaded_worker
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.rewards.config import RewardConfig
from gspo_megatron.rollout.rewards.in_process import InProcessCaller
from gspo_megatron.rollout.rewards.registry import RewardFn, is_trivial_reward, resolve_reward
from gspo_megatron.rollout.rewards.types import FAILURE_KINDS, RewardResult


def call_reward(fn: RewardFn, response: str, record: PromptRecord) -> RewardResult:
    """Call a verifier; every way it can fail becomes a failed (0-reward) result of its kind."""
    try:
        result = fn(response, record)
    except Exception as error:  # noqa: BLE001 - the verifier's bug costs this sample only
        return RewardResult.failed(f"verifier raised {type(error).__name__}: {error}", "raised")
    try:  # inside the guard: a RewardResult holding a string or an array must not crash the caller
        result = as_reward_result(result)
    except TypeError as error:
        return RewardResult.failed(str(error), "bad_type")
    try:
        reward = _real_field("reward", result.reward)
        correct, format_ok = _flag_field("correct", result.correct), _flag_field("format_ok", result.format_ok)
    except Exception as error:  # noqa: BLE001 - our TypeError, or whatever a strange number's float() raises
        return RewardResult.failed(f"verifier returned a bad RewardResult: {error}", "bad_type")
    if not math.isfinite(reward):
        return RewardResult.failed(f"verifier returned reward {reward}", "nonfinite")
    try:
        turn_rewards = _turn_rewards(result.turn_rewards, record)
    except TypeError as error:
        return RewardResult.failed(f"verifier returned bad turn_rewards: {error}", "bad_type")
    if turn_rewards is not None and not all(math.isfinite(r) for r in turn_rewards):
        return RewardResult.failed(f"verifier returned turn_rewards {turn_rewards}", "nonfinite")
    message = None if result.error is None else str(result.error)
    failure = None if message is None else (result.failure or "verifier")
    return RewardResult(reward, correct, format_ok, message, failure, turn_rewards)


def as_reward_result(value: object) -> RewardResult:
    """A verifier's return as a RewardResult: one as it is; a bool ``b`` -> ``RewardResult(float(b), b, True)``;
    a real number ``x`` -> ``RewardResult(float(x), x > 0, True)`` (a positive reward counts as correct).
    Anything else raises TypeError naming what came back and what to return."""
    if isinstance(value, RewardResult):
        return value
    if _is_bool(value):
        return RewardResult(reward=1.0 if value else 0.0, correct=bool(value), format_ok=True)
    with contextlib.suppress(TypeError):
        reward = _real_number(value)  # a number, or a one-element tensor or array
        return RewardResult(reward=reward, correct=reward > 0, format_ok=True)
    raise TypeError(
        f"verifier returned {type(value).__name__} ({_shown(value)}), expected a RewardResult, a real number "
        "(correct when > 0) or a bool"
    )


def _is_bool(value: object) -> bool:
    numpy = sys.modules.get("numpy")  # a numpy bool exists only where numpy was imported
    return isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _real_number(value: object) -> float:
    """A real number as float: a Python or numpy number, or a one-element tensor or array (a reward model's
    score); a string is refused even when it parses (``float("1")`` would). TypeError otherwise."""
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "dtype") and not isinstance(value, (str, bytes)):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            return float(value)  # type: ignore[arg-type]  # one element (more raise)
    raise TypeError(f"{value!r} is not a real number")


def _real_field(name: str, value: object) -> float:
    try:
        return _real_number(value)
    except TypeError:
        raise TypeError(
            f"RewardResult.{name} is {value!r} ({type(value).__name__}); return a real number, e.g. {name}=1.0"
        ) from None


def _flag_field(name: str, value: object) -> bool:
    """A bool, or the integers 0/1; ``bool(value)`` would call the string "false" true."""
    if _is_bool(value):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):  # bool is an int
        return bool(value)
    raise TypeError(
        f"RewardResult.{name} is {value!r} ({type(value).__name__}); return a bool, e.g. {name}=(answer == gold)"
    )


def _turn_rewards(values: object, record: PromptRecord) -> tuple[float, ...] | None:
    """A trajectory's per-turn rewards as floats, one per turn of ``record.trajectory``; TypeError otherwise
    (a string, a count that is not the turns', per-turn rewards for a single response)."""
    if values is None:
        return None
    if record.trajectory is None:
        raise TypeError(
            "per-turn rewards are for multi-turn trajectories (rollout.agent), and this sample is one response; "
            "return turn_rewards=None"
        )
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{_shown(values)} is not a sequence; return one real number per turn, e.g. (0.0, 1.0)")
    turns = len(record.trajectory.turns)
    if len(values) != turns:
        raise TypeError(f"{len(values)} values for a trajectory of {turns} turns; return one per turn")
    return tuple(_real_field("turn_rewards[]", value) for value in values)


def _worker_main(conn: Connection, reward_name: str) -> None:
    # Ctrl-C and SIGTERM are the trainer's to handle: it closes the pool (workers must not die
    # mid-reply on a signal sent to the whole process group).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    single_threaded_worker()  # the thread rule's reward workers (core/threads.py), before the verifier loads
    try:
        fn = resolve_reward(reward_name)
        warm_up = getattr(fn, "warm_up", None)
        if warm_up is not None:
            warm_up()
    except BaseException as error:  # noqa: BLE001 - report why this worker cannot serve, then exit
        conn.send(("fatal", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the pool went away
            return
        if message is None:
            return
        index, response, record = message
        conn.send(("result", index, call_reward(fn, response, record)))


@dataclass
class PoolStats:
    scored: int = 0
    errors: int = 0  # samples whose result carries an error (raised, bad return, timeout, crash, ...)
    failures: dict = field(default_factory=lambda: {kind: 0 for kind in FAILURE_KINDS})  # errors per kind
    timeouts: int = 0
    crashes: int = 0  # the worker process died during a call
    restarts: int = 0


class _Worker:
    def __init__(self, context, reward_name: str, startup_timeout_s: float):
        parent_end, child_end = context.Pipe(duplex=True)
        self.process = context.Process(target=_worker_main, args=(child_end, reward_name), daemon=True)
        self.process.start()
        child_end.close()  # so the parent sees EOF when the worker dies
        self.conn = parent_end
        self.state = "starting"  # starting -> idle <-> busy
        self.task: int | None = None
        self.deadline = time.monotonic() + startup_timeout_s

    def assign(self, index: int, response: str, record: PromptRecord, timeout_s: float) -> None:
        self.conn.send((index, response, record))
        self.state, self.task, self.deadline = "busy", index, time.monotonic() + timeout_s

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()


class RewardPool:
    """Scores (response, record) pairs with one reward function; see the module docstring."""

    def __init__(self, reward_name: str, config: RewardConfig | None = None):
        self.config = config or RewardConfig()  # validated at construction (ConfigNode)
        self.reward_name = reward_name
        self._fn = resolve_reward(reward_name)  # fail fast in the parent on a bad name
        self.stats = PoolStats()
        self._workers: list[_Worker] = []
        self._start_failures = 0
        in_process = self.config.in_process
        self.in_process = is_trivial_reward(reward_name) if in_process is None else in_process
        self._caller: InProcessCaller | None = None
        if self.in_process:
            score_one = functools.partial(call_reward, self._fn)
            warm_up = getattr(self._fn, "warm_up", None)
            self._caller = InProcessCaller(score_one, warm_up, reward_name, self.config)
        else:
            self._context = multiprocessing.get_context(self.config.start_method)
            if self.config.start_method == "forkserver":
                # The fork server imports this package once (torch included, via the shared
                # Registry), so each new worker forks from it in milliseconds instead of
                # re-importing. Only takes effect if this process's fork server is not running yet.
                self._context.set_forkserver_preload(["gspo_megatron.rollout.rewards"])
            self._workers = [self._new_worker() for _ in range(self.config.num_workers)]

    def _new_worker(self) -> _Worker:
        return _Worker(self._context, self.reward_name, self.config.startup_timeout_s)

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self._workers[self._workers.index(worker)] = self._new_worker()
        self.stats.restarts += 1

    def score(self, responses: Sequence[str], records: Sequence[PromptRecord]) -> list[RewardResult]:
        if len(responses) != len(records):
            raise ValueError(f"{len(responses)} responses but {len(records)} records; pass one record per response")
        if self._caller is not None:
            results = self._caller.score_all(responses, records)
            self.stats.timeouts += sum(r.failure == "timeout" for r in results)
        else:
            if not self._workers:
                raise RuntimeError("RewardPool is closed; build a new one")
            results = self._score_in_workers(responses, records)
        self.stats.scored += len(results)
        self.stats.errors += sum(r.error is not None for r in results)
        for result in results:
            if result.failure is not None:
                self.stats.failures[result.failure] += 1
        return results

    def _score_in_workers(self, responses, records) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(responses)
        pending = deque(range(len(responses)))
        while pending or any(w.state == "busy" for w in self._workers):
            for worker in [w for w in self._workers if w.state == "idle"]:
                if not pending:
                    break
                index = pending.popleft()
                try:
                    worker.assign(index, responses[index], records[index], self.config.timeout_s)
                except (BrokenPipeError, OSError):  # died while idle: nobody's sample was lost
                    pending.appendleft(index)
                    self._replace(worker)
            self._collect(results)
        return results  # type: ignore[return-value]

    def _collect(self, results: list[RewardResult | None]) -> None:
        """Wait for the first message or deadline, then handle replies, crashes and timeouts."""
        waiting = [w for w in self._workers if w.state in ("starting", "busy")]
        if not waiting:
            return
        timeout = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
        ready = set(wait([w.conn for w in waiting], timeout=timeout))
        for worker in waiting:
            if worker.conn in ready:
                self._receive(worker, results)
            elif time.monotonic() >= worker.deadline:
                self._expire(worker, results)

    def _receive(self, worker: _Worker, results: list[RewardResult | None]) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=10)
            code = worker.process.exitcode
            if worker.state == "busy" and worker.task is not None:
                results[worker.task] = RewardResult.failed(f"verifier process died (exit code {code})", "died")
                self.stats.crashes += 1
            else:
                self._start_failed(f"worker died while starting (exit code {code})")
            self._replace(worker)
            return
        if message[0] == "fatal":
            raise RuntimeError(f"reward workers cannot load {self.reward_name!r}: {message[1]}")
        if message[0] == "result":
            results[message[1]] = message[2]
        else:  # "ready"
            self._start_failures = 0
        worker.state, worker.task = "idle", None

    def _expire(self, worker: _Worker, results: list[RewardResult | None]) -> None:
        if worker.state == "busy" and worker.task is not None:
            results[worker.task] = RewardResult.failed(
                f"verifier timed out after {self.config.timeout_s} s (reward.timeout_s)", "timeout"
            )
            self.stats.timeouts += 1
        else:
            self._start_failed(f"worker not ready within reward.startup_timeout_s={self.config.startup_timeout_s} s")
        self._replace(worker)

    def _start_failed(self, reason: str) -> None:
        self._start_failures += 1
        if self._start_failures >= self.config.max_start_failures:
            raise RuntimeError(
                f"reward workers failed to start {self._start_failures} times in a row ({reason}); "
                f"check that {self.reward_name!r} imports cleanly in a fresh process, and that the main "
                f"script is importable (a file with an `if __name__ == '__main__':` guard, not stdin)"
            )

    def close(self) -> None:
        """Stop the workers (or the in-process call thread) this pool started. Safe to call twice."""
        if self._caller is not None:
            self._caller.close()  # a later score() starts a fresh thread
        for worker in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                worker.conn.send(None)
        for worker in self._workers:
            worker.process.join(timeout=2)
            worker.stop()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
