"""Streaming asynchronous rollout: a producer thread generates groups continuously, at most k weight versions
ahead of the trainer (``rollout.async_rollout=true``, ``rollout.max_staleness=k`` > 1, ``rollout.staleness_mode``).

    producer:  [round r: G groups, generated + scored -> buffer][round r + 1][gate / room wait][round r + 2]..
    trainer:   take(step): G groups admitted at version ``step`` -> assemble -> train -> weight sync (between rounds)

Design decisions:
- One producer thread for the run, started at the first ``take`` (the engine holds the run's weights by then),
  whatever the engine: the embedded one, or SGLang's client (its calls run on its own event loop, so the
  producer's requests and the trainer's weight-sync calls may come from two threads; a round's groups spread
  over the servers by load). A
  round is a step's worth of fresh groups (``RolloutProducer.draw_round``: generate, score), seeded as the
  synchronous run's step of the round's index, so under ``wait`` step s trains round s's prompts and seeds. What
  depends on the step that trains a group -- shaping's strength, the advantages, packing -- runs at ``take``
  (``RolloutProducer.assemble``).
- Rounds and weight syncs take turns on the engine (``EngineTurns``): a sync waits for the round in flight and
  goes before the next round, so weights land between rounds, never inside one. Every sample therefore carries
  one version, the engine's (``Sample.weight_version``), and with R3 the routed experts of that version.
- ``rollout.inflight_update_mode=in_place|retract`` (default ``off``: the turns above): a sync does not wait
  for the round in flight but lands in it (``RolloutSide.load_weights`` -> ``rollout/inflight_sync.py`` ->
  ``EmbeddedEngine.request_update``, at the decode loop's next step boundary, bounded wait on the ticket; or
  SGLang's servers paused in that mode, ``SGLangEngine.update_weights_in_flight``), then advances the gate. A
  sample may then span versions: each token's is in ``Sample.extra["token_versions"]``, admission counts a
  group by its oldest token, ``Sample.weight_version`` (the batch's ``policy_versions``, the trainer's bound
  check) is the oldest, and each token's engine log-prob is the forward that sampled it, which
  the decoupled loss weighs against pi_old token by token. ``in_place`` keeps each position's routing row, so
  R3 stays exact; ``retract`` with engine routing is refused at start-up (``config/validate.py``: it ends
  rerouted rows, ``ABORT``). Checkpoints and evaluation still take the trainer's turn between rounds.
- Admission is by group, by its oldest token (``GroupBuffer.take`` -> ``admit_groups``), at the trained version
  v_train = step (step s trains on the weights of s optimizer steps).
- ``wait``: before a round the producer acquires G groups at the gate (group n starts on version v iff
  n < (v + k + 1) G), so nothing passes the bound and a dropped group is a bug (``StalenessError``). ``drop``: the
  producer waits only for room, at most ``DROP_RUN_AHEAD`` x (k + 1) G groups buffered: (k + 1) G is what the
  bound can still train from one version; the rest is generation the engine does instead of idling, dropped at
  ``take`` when too old.
- The trainer checks the bound itself too: every trained sample's version within k of the step
  (``StalenessError``), whatever the policy.
- Resume rule: the buffered groups are not checkpointed; a resumed run drops them, their prompts spent (counted
  once, ``async/groups_dropped_at_resume`` at its first step). The checkpoint holds the task's position and the
  next round's index, both read while the producer is paused between rounds (``paused``), so a resumed run
  draws the prompts and seeds that follow the buffered ones, on the resumed weights. Why not continue them: the
  cost of dropping is at most the buffer, (k + 1) G groups' generation under ``wait``, and the checkpoint then
  holds no scored groups (rewards, shaping views) whose format would have to stay readable across versions.
- Metrics (one set every step): ``async/staleness_max``, ``async/staleness_mean``, ``async/policy_version_min``
  as the one-step scheduler's; the admitted tokens by age (``async/stale_token_frac``,
  ``async/stale_tokens_age_<a>``, each token at its own version); ``async/samples_spanning_versions`` (admitted
  samples an in-flight update landed in); ``async/groups_dropped`` (this take) and ``async/groups_buffered`` (left
  after it). Timings under ``time/``: ``time/trainer_idle_frac`` = the take's wait
  for groups / the step's cycle (from the previous take's return to this one's: train, sync, wait; the first
  step's from the producer's start);
  ``time/engine_idle_frac`` = the producer's time waiting at the gate or for room within that same cycle / the
  cycle (a wait still in progress at the take counted up to it), so each step's value is its own and a
  cycle-weighted mean over steps is the run's.
- Every wait is bounded by ``wait_bound_s`` (``WAIT_BOUND_S``); a timeout raises naming what was awaited. A
  failed round closes the buffer, and the trainer's take re-raises its error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic

from gspo_megatron.rollout.config import InflightUpdateMode, StalenessMode
from gspo_megatron.rollout.scheduler import StalenessError
from gspo_megatron.rollout.staleness import (
    BufferClosed,
    GateClosed,
    GroupBuffer,
    GroupT,
    StalenessGate,
    stale_token_metrics,
)

# The longest any wait here may last (a round, a weight sync, a take): past it the run stops with an error.
WAIT_BOUND_S = 3600.0
# drop: the buffer holds at most this many times (k + 1) G groups (module docstring)
DROP_RUN_AHEAD = 2


class EngineTurns:
    """The producer's rounds and the trainer's turns (a weight sync, a checkpoint's read) take turns on the engine;
    a trainer waiting goes before the next round (Python's locks are not fair: a producer re-taking one at once
    could starve the sync)."""

    def __init__(self, wait_bound_s: float) -> None:
        self.wait_bound_s = wait_bound_s
        self._condition = threading.Condition()
        self._in_round = False
        self._trainer_waiting = 0
        self._trainer_holds = False
        self._closed = False

    def begin_round(self) -> bool:
        """The producer's turn for one round; False when closed."""
        with self._condition:
            free = self._condition.wait_for(
                lambda: self._closed or not (self._trainer_holds or self._trainer_waiting), self.wait_bound_s
            )
            if not free:
                raise TimeoutError(f"the producer waited {self.wait_bound_s} s for the trainer's turn on the engine")
            if self._closed:
                return False
            self._in_round = True
            return True

    def end_round(self) -> None:
        with self._condition:
            self._in_round = False
            self._condition.notify_all()

    def begin_trainer_turn(self) -> None:
        """The trainer's turn: after the round in flight, before the next."""
        with self._condition:
            self._trainer_waiting += 1
            try:
                free = self._condition.wait_for(lambda: not (self._in_round or self._trainer_holds), self.wait_bound_s)
            finally:
                self._trainer_waiting -= 1
            if not free:
                raise TimeoutError(f"the trainer waited {self.wait_bound_s} s for the producer's round to finish")
            self._trainer_holds = True

    def end_trainer_turn(self) -> None:
        with self._condition:
            self._trainer_holds = False
            self._condition.notify_all()

    @property
    def trainer_holds(self) -> bool:
        with self._condition:
            return self._trainer_holds

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()


class StreamingScheduler(Generic[GroupT]):
    """Hands out each step's rollout from the groups a producer thread streams into a bounded buffer."""

    def __init__(
        self,
        draw_round: Callable[[int], list[GroupT]],
        assemble: Callable[[int, list[GroupT]], tuple[Any, dict[str, float]]],
        token_versions_of: Callable[[GroupT], list[int]],
        versions_of: Callable[[Any], list[int]],
        max_staleness: int,
        mode: StalenessMode,
        groups_per_step: int,
        last_step: int,
        wait_bound_s: float = WAIT_BOUND_S,
        inflight_update_mode: InflightUpdateMode = InflightUpdateMode.off,
        spanning_samples_of: Callable[[GroupT], int] = lambda group: 0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """``draw_round(r)``: round r's groups; ``assemble(step, groups)``: the step's (batch, metrics);
        ``token_versions_of``: a group's tokens' versions (admission); ``versions_of``: a batch's samples'
        versions (the trainer's check); ``last_step``: trainer.steps (under ``wait`` no round past it);
        ``inflight_update_mode``: off, a sync waits for the round in flight; else it lands in it (module docstring);
        ``spanning_samples_of``: how many of a group's samples hold tokens of more than one version; ``clock``: the
        idle fractions' time source (seconds)."""
        if max_staleness < 2:
            raise ValueError(
                f"rollout.max_staleness={max_staleness}: streaming is for a bound above 1 (rollout/scheduler.py "
                "runs 0 and 1)"
            )
        self.draw_round, self.assemble = draw_round, assemble
        self.versions_of = versions_of
        self.max_staleness, self.mode, self.groups_per_step = max_staleness, StalenessMode(mode), groups_per_step
        self.last_step, self.wait_bound_s = last_step, wait_bound_s
        self.inflight_update_mode = InflightUpdateMode(inflight_update_mode)
        self.spanning_samples_of = spanning_samples_of
        self.clock = clock
        self.buffer: GroupBuffer[GroupT] = GroupBuffer(max_staleness, token_versions_of)
        self.turns = EngineTurns(wait_bound_s)
        self.gate: StalenessGate | None = None  # wait: built at start, at the trainer's version
        self._next_round: int | None = None  # None: the first step's index (a fresh run: 0)
        self._dropped_at_resume = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._progress = threading.Condition()  # guards the counters below
        self._blocks = 0  # times the producer found no capacity or room and waited
        self._idle_s = 0.0  # the producer's finished waits at the gate or for room
        self._waiting_since: float | None = None  # when the producer's wait in progress began
        self._idle_at_last_take = 0.0  # the producer's idle time up to the previous take
        self._last_take = 0.0
        self._final_round = 0
        self._finished = False  # the producer thread returned

    # ------------------------------------------------------------------ the trainer's calls
    def start(self, version: int) -> None:
        """The producer thread, from the engine's ``version`` on (the first ``take`` calls it)."""
        if self._thread is not None:
            return
        if self._next_round is None:
            self._next_round = version
        # under wait every round is trained: the rounds the remaining steps need, no more
        self._final_round = self._next_round + self.last_step - version
        if self.mode is StalenessMode.wait:
            self.gate = StalenessGate(self.max_staleness, self.groups_per_step, version)
        self._last_take = self.clock()
        self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
        self._thread.start()

    def take(self, step: int) -> tuple[Any, dict[str, float]]:
        """Step ``step``'s (batch, metrics) from ``groups_per_step`` groups admitted at version ``step``."""
        self.start(step)
        wait_start = self.clock()
        try:
            admission = self.buffer.take(self.groups_per_step, step, self.wait_bound_s)
        except BufferClosed:
            self._raise_producer_error()
            raise
        waited_until = self.clock()
        if admission.dropped and self.mode is StalenessMode.wait:
            raise StalenessError(
                f"step {step}: {len(admission.dropped)} group(s) past rollout.max_staleness={self.max_staleness} "
                "under rollout.staleness_mode=wait, whose gate should have held them back"
            )
        batch, metrics = self.assemble(step, admission.admitted)
        versions = self.versions_of(batch)
        staleness = [step - v for v in versions]
        if max(staleness) > self.max_staleness or min(staleness) < 0:
            raise StalenessError(
                f"step {step} got samples of policy versions {sorted(set(versions))}: staleness "
                f"{max(staleness)} exceeds rollout.max_staleness={self.max_staleness}"
            )
        now, engine_idle_s = self._engine_idle_since_last_take()
        cycle, self._last_take = now - self._last_take, now
        dropped_at_resume, self._dropped_at_resume = self._dropped_at_resume, 0
        metrics = {
            **metrics,
            "async/staleness_max": float(max(staleness)),
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/policy_version_min": float(min(versions)),
            **stale_token_metrics(admission.ages, self.max_staleness, "async/"),
            "async/samples_spanning_versions": float(sum(map(self.spanning_samples_of, admission.admitted))),
            "async/groups_dropped": float(len(admission.dropped)),
            "async/groups_dropped_at_resume": float(dropped_at_resume),
            "async/groups_buffered": float(len(self.buffer)),
            "time/trainer_idle_frac": (waited_until - wait_start) / cycle if cycle > 0 else 0.0,
            "time/engine_idle_frac": engine_idle_s / cycle if cycle > 0 else 0.0,
        }
        return batch, metrics

    def start_next(self, step: int) -> None:
        """Nothing to start: the producer runs on its own (the one-step scheduler's call)."""

    def before_weight_sync(self) -> None:
        """The trainer's turn on the engine: the round in flight finishes on the weights it started with (with
        in-flight updates no turn: the sync lands inside the round)."""
        self._raise_producer_error()
        if self.inflight_update_mode == InflightUpdateMode.off:
            self.turns.begin_trainer_turn()

    def after_weight_sync(self, version: int | None) -> None:
        """The engine holds ``version`` now (None: the load failed): the gate opens for it, the producer goes on."""
        if version is not None and self.gate is not None:
            self.gate.advance(version)
        if self.turns.trainer_holds:
            self.turns.end_trainer_turn()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No round runs inside: what the producer drew so far (the task's position) is all in the buffer."""
        self.turns.begin_trainer_turn()
        try:
            yield
        finally:
            self.turns.end_trainer_turn()

    def _engine_idle_since_last_take(self) -> tuple[float, float]:
        """(now, the producer's waiting time between the previous take (or its start) and now), a wait in progress
        counted up to now; the next call counts from now. ``now`` is read under the lock the producer records its
        waits under: a wait that ended after a clock read taken outside it (the take frees room, the producer's wait
        for it ends at once) counted idle time past the cycle's end, a fraction above 1 (1.019 in CI, under drop)."""
        with self._progress:
            now = self.clock()
            in_progress = now - self._waiting_since if self._waiting_since is not None else 0.0
            idle_until_now = self._idle_s + in_progress
            idle_s, self._idle_at_last_take = idle_until_now - self._idle_at_last_take, idle_until_now
            return now, idle_s

    def wait_until_blocked(self, blocks: int, timeout_s: float) -> int:
        """Until the producer has waited for capacity or room more than ``blocks`` times, or stopped; returns the
        count."""
        with self._progress:
            if not self._progress.wait_for(lambda: self._blocks > blocks or self._finished, timeout_s):
                raise TimeoutError(f"the producer did not block again within {timeout_s} s ({self._blocks} so far)")
            self._raise_producer_error()
            return self._blocks

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Read inside ``paused``: the next round's index, and the buffered groups a resumed run drops."""
        return {"next_round": self._next_round, "buffered_groups": len(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        """A one-step scheduler's state holds no round (the resumed step's index is used) and may hold the batch it
        prefetched (``ready``): dropped as the buffer is, its G groups counted."""
        self._next_round = state.get("next_round")
        prefetched = self.groups_per_step if state.get("ready") is not None else 0
        self._dropped_at_resume = int(state.get("buffered_groups", prefetched))

    def close(self) -> None:
        """Stop the producer (bounded: it finishes the round in flight)."""
        self.turns.close()
        self.buffer.close()
        if self.gate is not None:
            self.gate.close()
        if self._thread is not None:
            self._thread.join(self.wait_bound_s)
            if self._thread.is_alive():
                raise TimeoutError(f"the rollout producer did not stop within {self.wait_bound_s} s")

    # ------------------------------------------------------------------ the producer thread
    def _produce(self) -> None:
        try:
            while self._room_for_a_round():
                if not self.turns.begin_round():
                    return
                try:
                    round_index = self._round_index()
                    self.buffer.put(self.draw_round(round_index))  # inside the turn: a pause sees it buffered
                    self._next_round = round_index + 1
                finally:
                    self.turns.end_round()
        except GateClosed:
            return
        except BaseException as error:  # noqa: BLE001 - re-raised in the trainer's thread (take, before_weight_sync)
            with self._progress:
                self._error = error
            self.buffer.close()
        finally:
            with self._progress:
                self._finished = True
                self._progress.notify_all()

    def _round_index(self) -> int:
        if self._next_round is None:
            raise RuntimeError("the producer runs only after start() set its first round")
        return self._next_round

    def _room_for_a_round(self) -> bool:
        """Wait (bounded) until the next round may start: the gate under ``wait``, room under ``drop``."""
        groups, gate = self.groups_per_step, self.gate
        if gate is not None:
            if self._round_index() >= self._final_round:
                return False  # under wait every round is trained: nothing past the last step
            self._timed(gate.capacity() < groups, lambda: gate.acquire(groups, self.wait_bound_s))
            return True
        limit = DROP_RUN_AHEAD * (self.max_staleness + 1) * groups - groups + 1  # after a round: at most the run-ahead
        return bool(self._timed(len(self.buffer) >= limit, lambda: self.buffer.wait_for_room(limit, self.wait_bound_s)))

    def _timed(self, would_wait: bool, wait: Callable[[], Any]) -> Any:
        """Run ``wait``, counting it as a block when the producer found no capacity or room, and its time as idle."""
        with self._progress:
            started = self._waiting_since = self.clock()  # before the block is seen: a take counts it from here
            if would_wait:
                self._blocks += 1
                self._progress.notify_all()
        try:
            return wait()
        finally:
            with self._progress:
                self._idle_s += self.clock() - started
                self._waiting_since = None

    def _raise_producer_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the rollout producer thread failed") from self._error
