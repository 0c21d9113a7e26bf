"""The staleness bound: how many weight versions the tokens a step trains may lag, and what becomes of work
that would lag more (``rollout.max_staleness`` k). Partial rollouts admit carried groups through
``admit_groups`` and the schedulers count tokens by age (``stale_token_metrics``); ``StalenessGate`` (the
``wait`` policy) and ``GroupBuffer`` are what the streaming mode runs on (``rollout.max_staleness`` > 1,
``rollout.staleness_mode``: ``streaming.py``).

    age(token) = v_train - v_token      v_train: the version the step trains (its weights: steps trained so far)
                                        v_token: the version whose engine sampled the token
    a group is admitted at v_train  iff  max over its tokens of age <= k

Design decisions:
- Group-level admission: a group's samples train together (their advantages compare them with each other), so
  a group is admitted or dropped whole, by its oldest token (``admit_groups``). A sample stitched from several
  engine calls (partial rollouts) carries one version per token; its oldest token decides.
- Two policies:
  ``drop``  whatever was generated is offered at the step that would train it; a group past the bound is
            dropped there (counted), its prompt spent. The producer never waits for the trainer.
  ``wait``  the producer does not start work that could pass the bound (``StalenessGate``), so nothing is
            dropped: AReaL's capacity rule (inclusionAI/AReaL 4aef98d, ``areal/infra/staleness_manager.py:93``
            and ``:109``, ``(max_staleness + current_version + 1) * consumer_batch_size``), counted in groups:
                group n (0-based, in the order the trainer takes them, G per step) may start on version v
                iff  n < (v + k + 1) G
            -- it trains at step floor(n / G) <= v + k, so it lags at most k versions.
- Every wait is on a ``threading.Condition`` with a stated timeout; a timeout raises, naming what was awaited
  and for how long. ``StalenessGate.blocked`` is set while a producer waits: a test (or a metric) can see the
  block as an event rather than by timing it.
- Metrics, one set wherever groups are admitted (``stale_token_metrics``): the fraction of the admitted tokens
  older than the trained version, their count by age 1..k, and the groups dropped past the bound.

Where the bound is kept today: one-step asynchronous rollout (``scheduler.py``) keeps it by construction
(step s + 1's batch starts on version s, and the weight sync waits for it), its ``StalenessError`` the check;
partial rollouts (``agents/partial.py``) admit carried groups through ``admit_groups`` (``drop``); the streaming
mode (``streaming.py``) runs a producer up to k versions ahead on the gate (``wait``) or the buffer's room
(``drop``), and admits each step's groups through ``GroupBuffer.take``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

GroupT = TypeVar("GroupT")


def token_ages(token_versions: Iterable[int], train_version: int) -> Counter[int]:
    """How many tokens are of each age v_train - v_token; a token newer than ``train_version`` is refused."""
    ages = Counter(train_version - version for version in token_versions)
    if ages and min(ages) < 0:
        raise ValueError(
            f"a token of version {train_version - min(ages)} is newer than the trained version {train_version}"
        )
    return ages


def stale_token_metrics(ages: Counter[int], max_staleness: int, prefix: str) -> dict[str, float]:
    """``<prefix>stale_token_frac`` (tokens older than the trained version) and ``<prefix>stale_tokens_age_<a>``
    for a = 1..k: the same keys every step, whatever ages occurred."""
    tokens = sum(ages.values())
    return {
        f"{prefix}stale_token_frac": (tokens - ages[0]) / tokens if tokens else 0.0,
        **{f"{prefix}stale_tokens_age_{age}": float(ages[age]) for age in range(1, max_staleness + 1)},
    }


@dataclass(frozen=True)
class Admission(Generic[GroupT]):
    """The groups a step trains, those dropped past the bound, and the admitted tokens' ages."""

    admitted: list[GroupT]
    dropped: list[GroupT]
    ages: Counter[int] = field(default_factory=Counter)


def admit_groups(
    groups: Sequence[GroupT],
    token_versions_of: Callable[[GroupT], list[int]],
    train_version: int,
    max_staleness: int,
) -> Admission[GroupT]:
    """Each group whole, in order: admitted when its oldest token is at most ``max_staleness`` versions older
    than ``train_version`` (a group with no token yet is admitted), else dropped."""
    admitted, dropped, ages = [], [], Counter[int]()
    for group in groups:
        group_ages = token_ages(token_versions_of(group), train_version)
        if max(group_ages, default=0) > max_staleness:
            dropped.append(group)
        else:
            admitted.append(group)
            ages.update(group_ages)
    return Admission(admitted, dropped, ages)


class GateClosed(RuntimeError):
    """The gate was closed while a producer waited at it (the run is ending)."""


class StalenessGate:
    """The ``wait`` policy: a producer asks before starting groups, and waits while they could pass the bound
    (module docstring: group n may start on version v iff n < (v + k + 1) G)."""

    def __init__(self, max_staleness: int, groups_per_step: int, version: int = 0):
        if max_staleness < 0 or groups_per_step < 1:
            raise ValueError(
                f"rollout.max_staleness={max_staleness} must be >= 0 and the groups per step ({groups_per_step}) >= 1"
            )
        self.max_staleness, self.groups_per_step = max_staleness, groups_per_step
        self.version = version
        # a resumed run starts counting at its version (AReaL's on_version_recovered, staleness_manager.py:115)
        self.started = version * groups_per_step
        self.blocked = threading.Event()  # set while a producer waits here
        self.waits = 0  # how many acquisitions had to wait
        self._closed = False
        self._condition = threading.Condition()

    def capacity(self) -> int:
        """Groups that may start now: (v + k + 1) G - n."""
        return (self.version + self.max_staleness + 1) * self.groups_per_step - self.started

    def acquire(self, groups: int, timeout_s: float) -> None:
        """Start ``groups`` groups: at once when the bound allows, else after the trainer's versions advance far
        enough; ``TimeoutError`` after ``timeout_s`` seconds, ``GateClosed`` when closed meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            if self.capacity() < groups:
                self.waits += 1
            while not self._closed and self.capacity() < groups:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.blocked.clear()
                    raise TimeoutError(
                        f"the producer waited {timeout_s} s to start {groups} group(s) at version {self.version}: "
                        f"rollout.max_staleness={self.max_staleness} allows {self.capacity()} more until the "
                        "trainer's weights advance"
                    )
                self.blocked.set()  # under the lock: advance() clears it, so a set event is a current block
                self._condition.wait(remaining)
            self.blocked.clear()
            if self._closed:
                raise GateClosed("the staleness gate closed while the producer waited")
            self.started += groups

    def advance(self, version: int) -> None:
        """The engine holds the weights of ``version`` now: producers waiting for it may start."""
        with self._condition:
            if version < self.version:
                raise ValueError(f"weight version {version} after version {self.version}: versions only grow")
            self.version = version
            self.blocked.clear()  # a producer still short of capacity sets it again when it goes back to waiting
            self._condition.notify_all()

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()


class BufferClosed(RuntimeError):
    """The buffer was closed while the trainer waited for groups (the producer failed or the run is ending)."""


class GroupBuffer(Generic[GroupT]):
    """Groups generated ahead of training, oldest first. The producer puts; the trainer takes a step's groups,
    each admitted under the bound or dropped (``admit_groups``), waiting (bounded) until enough are admitted.
    ``put`` never blocks: under ``drop`` the producer bounds its own run-ahead (memory), under ``wait`` the gate."""

    def __init__(self, max_staleness: int, token_versions_of: Callable[[GroupT], list[int]]):
        self.max_staleness = max_staleness
        self.token_versions_of = token_versions_of
        self.dropped = 0  # groups dropped past the bound, over the run
        self._groups: deque[GroupT] = deque()
        self._closed = False
        self._condition = threading.Condition()

    def __len__(self) -> int:
        with self._condition:
            return len(self._groups)

    def put(self, groups: Iterable[GroupT]) -> None:
        with self._condition:
            self._groups.extend(groups)
            self._condition.notify_all()

    def wait_for_room(self, limit: int, timeout_s: float) -> bool:
        """The producer's run-ahead bound under ``drop``: until fewer than ``limit`` groups are buffered (True), or
        the buffer is closed (False); ``TimeoutError`` after ``timeout_s`` seconds. Without it a producer that
        re-takes the engine at once can starve the trainer's weight sync and fill memory with groups that will
        all be dropped."""
        with self._condition:
            if not self._condition.wait_for(lambda: self._closed or len(self._groups) < limit, timeout_s):
                raise TimeoutError(f"{len(self._groups)} group(s) still buffered after {timeout_s} s, limit {limit}")
            return not self._closed

    def close(self) -> None:
        """Wakes a producer waiting for room (it stops) and a trainer waiting for groups (``BufferClosed``)."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> None:
        """Until at least ``count`` groups are buffered; ``TimeoutError`` after ``timeout_s`` seconds."""
        with self._condition:
            if not self._condition.wait_for(lambda: len(self._groups) >= count, timeout_s):
                raise TimeoutError(f"{len(self._groups)} group(s) buffered after {timeout_s} s, {count} awaited")

    def take(self, count: int, train_version: int, timeout_s: float) -> Admission[GroupT]:
        """``count`` groups admitted at ``train_version``, oldest first, and those dropped on the way."""
        admitted: list[GroupT] = []
        dropped: list[GroupT] = []
        ages: Counter[int] = Counter()
        with self._condition:
            while len(admitted) < count:
                if not self._condition.wait_for(lambda: bool(self._groups) or self._closed, timeout_s):
                    raise TimeoutError(
                        f"the trainer waited {timeout_s} s for a group at version {train_version} "
                        f"({len(admitted)} of {count} admitted)"
                    )
                if not self._groups:
                    raise BufferClosed(f"the group buffer closed with {len(admitted)} of {count} groups admitted")
                admission = admit_groups(
                    [self._groups.popleft()], self.token_versions_of, train_version, self.max_staleness
                )
                admitted += admission.admitted
                dropped += admission.dropped
                ages.update(admission.ages)
            self.dropped += len(dropped)
            self._condition.notify_all()  # room for a producer waiting in wait_for_room
        return Admission(admitted, dropped, ages)
