"""One-step asynchronous rollout: generate step k+1's batch while step k trains (slime/verl async mode);
``rollout.max_staleness`` 0 or 1 (above 1: ``streaming.py``).

    sync (max_staleness=0):  [gen k][train k][sync] [gen k+1][train k+1][sync] ...
    async (max_staleness=1): [gen k][train k      ][join][sync][train k+1      ][join][sync]
                                    [gen k+1 ----]             [gen k+2 ----]

Design decisions:
- Driver-only: the driver thread that owns the engine starts ``produce(k + 1)`` in a background
  thread right after taking step k's batch; the main thread trains step k meanwhile. Before the
  weights change (``before_weight_sync``) the thread is joined, so a generation never straddles a
  weight update: every sample of a batch comes from one policy version, and with R3 the routed
  experts it carries (and the trainer replays) are exactly those that stale policy used.
- Staleness is counted in versions: the trainer syncs the weights after k trained steps as version
  k; a batch generated on version v and trained at step k (0-based) is k - v stale. The bound is
  enforced (``StalenessError``), not assumed, and every sample's version comes from the engine
  (``Sample.weight_version``).
- ``max_staleness=0`` never starts a thread: the synchronous schedule, step for step.
- The rollout's own log-probs stay in the batch (``rollout_log_probs``) and are what the mismatch
  correction weighs against, so a stale batch is corrected like an inference mismatch.
- A batch prefetched when a checkpoint is written is part of the checkpoint (``state_dict``), so a
  resumed run trains exactly the batch the uninterrupted run would have.
- Generation and training share the driver's CPU/GPU: ``time/generation_overlap_frac`` (the share
  of the generation that ran while training, not while the trainer waited for it) says what was
  gained. Timings are under ``time/`` (they differ run to run); staleness is under ``async/``, with the
  tokens by age (``async/stale_tokens_age_<a>``, ``rollout/staleness.py``) when the bound is above 0.
- The bound holds by construction here: step k + 1's batch starts on
  version k and the weight sync waits for it, so the producer never runs more than one version ahead (it
  waits) and nothing can need dropping. A bound above 1 is the streaming scheduler's (``streaming.py``: a
  producer thread, the group buffer and gate of ``rollout/staleness.py``); ``rollout/build.py`` picks one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gspo_megatron.rollout.config import check_max_staleness
from gspo_megatron.rollout.staleness import stale_token_metrics


class StalenessError(RuntimeError):
    """A batch would be trained on a policy more than ``max_staleness`` versions newer than its own."""


@dataclass
class _Pending:
    step: int
    thread: threading.Thread
    started: float
    result: Any = None
    error: BaseException | None = None
    finished: float = 0.0


class RolloutScheduler:
    """Hands out each step's rollout; with ``max_staleness=1`` the next one is generated in the background."""

    def __init__(
        self,
        produce: Callable[[int], tuple[Any, dict]],
        max_staleness: int,
        last_step: int,
        versions_of: Callable[[Any], list[int]],
        carried_staleness: int = 0,
        tokens_of: Callable[[Any], list[int]] | None = None,
    ):
        """``carried_staleness``: the versions a sample carried between steps may lag (partial rollouts,
        ``rollout.partial=continue``: ``rollout.max_staleness``); the one-step-ahead generation is
        ``max_staleness``'s alone. ``tokens_of``: each sample's response tokens, which the stale-token
        metrics count at the sample's version (None: one per sample)."""
        check_max_staleness(max_staleness)
        self.carried_staleness = carried_staleness
        self.tokens_of = tokens_of
        self.produce = produce
        self.max_staleness = max_staleness
        self.last_step = last_step
        self.versions_of = versions_of  # the policy version of every sample of a produced batch
        self._pending: _Pending | None = None
        self._ready: tuple[int, Any, dict] | None = None  # (step, result, metrics) joined, not yet taken

    # ------------------------------------------------------------------ the trainer's calls
    def take(self, step: int) -> tuple[Any, dict[str, float]]:
        """Step ``step``'s (batch, metrics): the prefetched one if it exists, else produced now."""
        self._join()
        if self._ready is not None and self._ready[0] == step:
            _, (result, metrics), timing = self._ready
            self._ready = None
        else:
            started = time.perf_counter()
            result, metrics = self.produce(step)
            elapsed = time.perf_counter() - started
            timing = {"time/generation": elapsed, "time/generation_overlap_frac": 0.0}
        versions = self.versions_of(result)
        staleness = [step - v for v in versions]
        bound = max(self.max_staleness, self.carried_staleness)
        if max(staleness) > bound or min(staleness) < 0:
            raise StalenessError(
                f"step {step} got samples of policy versions {sorted(set(versions))}: staleness "
                f"{max(staleness)} exceeds rollout.max_staleness={bound}"
            )
        metrics = {
            **metrics,
            **timing,
            "async/staleness_max": float(max(staleness)),
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/policy_version_min": float(min(versions)),
        }
        if bound > 0:
            metrics.update(stale_token_metrics(self._token_ages(result, staleness), bound, "async/"))
        return result, metrics

    def _token_ages(self, result: Any, staleness: list[int]) -> Counter[int]:
        """Tokens by age, each counted at its sample's version: exact where a sample is one engine call (one-step
        async); partial rollouts count their stitched samples' tokens one by one (``rollout/partial/``)."""
        tokens = self.tokens_of(result) if self.tokens_of is not None else [1] * len(staleness)
        ages: Counter[int] = Counter()
        for age, count in zip(staleness, tokens, strict=True):
            ages[age] += count
        return ages

    def start_next(self, step: int) -> None:
        """Begin generating step ``step``'s batch on the engine's current weights (async mode only)."""
        if self.max_staleness == 0 or step >= self.last_step or self._pending is not None:
            return
        pending = _Pending(
            step, threading.Thread(target=self._run, name=f"rollout-step-{step}", daemon=True), time.perf_counter()
        )
        self._pending = pending
        pending.thread.start()

    def before_weight_sync(self) -> None:
        """Wait for an in-flight generation: the engine's weights must not change under it."""
        self._join()

    def after_weight_sync(self, version: int | None) -> None:
        """Nothing to resume: the next generation starts at the next ``take``."""

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No generation runs inside (a checkpoint reads the task's position here)."""
        self._join()
        yield

    def close(self) -> None:
        """Nothing runs past the last step (``start_next``), and each generation is joined before a sync."""

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        self._join()
        return {"ready": self._ready}

    def load_state_dict(self, state: dict) -> None:
        self._ready = state.get("ready")

    # ------------------------------------------------------------------ internals
    def _run(self) -> None:
        pending = self._pending
        if pending is None:
            raise RuntimeError("the rollout thread started with nothing to produce")
        try:
            pending.result = self.produce(pending.step)
        except BaseException as error:  # noqa: BLE001 - re-raised in the trainer's thread by _join
            pending.error = error
        pending.finished = time.perf_counter()

    def _join(self) -> None:
        pending = self._pending
        if pending is None:
            return
        wait_start = time.perf_counter()
        pending.thread.join()
        waited = time.perf_counter() - wait_start
        self._pending = None
        if pending.error is not None:
            raise RuntimeError(f"background rollout for step {pending.step} failed") from pending.error
        generation = pending.finished - pending.started
        overlap = max(0.0, generation - waited) / generation if generation > 0 else 0.0
        timing = {"time/generation": generation, "time/generation_overlap_frac": overlap}
        self._ready = (pending.step, pending.result, timing)
