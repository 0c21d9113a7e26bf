"""The staleness bound (rollout/staleness.py): group admission by hand, the wait policy's gate, and a fast engine
feeding a slow trainer through the buffer under ``drop`` and ``wait`` -- no trained token older than k versions."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from gspo_megatron.contracts.samples import Sample, SamplingParams
from gspo_megatron.rollout.config import EmbeddedConfig
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.staleness import (
    GateClosed,
    GroupBuffer,
    StalenessGate,
    admit_groups,
    stale_token_metrics,
    token_ages,
)
from gspo_megatron.testing.model_fixtures import tiny_qwen3_moe_hf_config as _hf_config
from gspo_megatron.testing.model_fixtures import tiny_qwen3_moe_hf_weights as _weights

WAIT_S = 120.0  # bound on every wait below (never reached when the code is right)


def test_admission_is_per_group_by_its_oldest_token():
    # token versions per group, admitted at version 5 with k = 2: a group with one token of version 2 goes whole
    groups = {"fresh": [5, 5, 4], "mixed": [3, 5, 5], "one_old_token": [2, 5, 5, 5], "unstarted": []}
    admission = admit_groups(list(groups), groups.__getitem__, train_version=5, max_staleness=2)
    assert admission.admitted == ["fresh", "mixed", "unstarted"] and admission.dropped == ["one_old_token"]
    assert admission.ages == Counter({0: 4, 1: 1, 2: 1})
    metrics = stale_token_metrics(admission.ages, 2, "async/")
    assert metrics == {
        "async/stale_token_frac": 2 / 6,
        "async/stale_tokens_age_1": 1.0,
        "async/stale_tokens_age_2": 1.0,
    }
    with pytest.raises(ValueError, match="a token of version 6 is newer than the trained version 5"):
        token_ages([6], 5)


def test_the_gate_is_areals_capacity_rule():
    """group n may start on version v iff n < (v + k + 1) G: k = 1, G = 2 -> 4 groups on version 0, 6 by version 1."""
    gate = StalenessGate(max_staleness=1, groups_per_step=2)
    gate.acquire(3, WAIT_S)
    assert gate.capacity() == 1
    gate.acquire(1, WAIT_S)
    with pytest.raises(TimeoutError, match=r"allows 0 more until the trainer's weights advance"):
        gate.acquire(1, 0.0)  # no time to wait: refused at once, nothing started
    assert gate.started == 4 and not gate.blocked.is_set()
    gate.advance(1)
    assert gate.capacity() == 2
    resumed = StalenessGate(max_staleness=1, groups_per_step=2, version=3)  # counts from its version (a resume)
    assert resumed.capacity() == 4
    with pytest.raises(ValueError, match="versions only grow"):
        gate.advance(0)


def test_a_closed_gate_releases_a_waiting_producer():
    gate = StalenessGate(max_staleness=0, groups_per_step=1)
    gate.acquire(1, WAIT_S)
    raised: list[BaseException] = []

    def produce():
        try:
            gate.acquire(1, WAIT_S)
        except GateClosed as error:
            raised.append(error)

    producer = threading.Thread(target=produce)
    producer.start()
    assert gate.blocked.wait(WAIT_S)
    gate.close()
    producer.join(WAIT_S)
    assert not producer.is_alive() and len(raised) == 1


PROMPT = [[1, 2, 3, 4, 5]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=5)


def _token_versions(group: list[Sample]) -> list[int]:
    return [sample.weight_version for sample in group for _ in sample.output_ids]


class _Pipeline:
    """A fast engine and a slow trainer: the real embedded engine generates groups in its own thread into the
    buffer; the trainer's weight sync waits for the round in flight (the engine lock), as scheduler.py's does.
    Under ``drop`` (no gate) the producer keeps at most ``AHEAD`` groups buffered (``wait_for_room``)."""

    AHEAD = 3

    def __init__(self, max_staleness: int, gate: StalenessGate | None):
        self.engine = EmbeddedEngine(_hf_config(), EmbeddedConfig())
        self.weights = [_weights(1), _weights(2)]
        self.engine.update_weights(self.weights[0].items(), version=0)
        self.buffer: GroupBuffer[list[Sample]] = GroupBuffer(max_staleness, _token_versions)
        self.gate, self.lock, self.stop = gate, threading.Lock(), threading.Event()
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._produce, name="producer", daemon=True)

    def _produce(self) -> None:
        try:
            for _ in range(60):  # a bound on the work, far above what the trainer takes
                if self.stop.is_set():
                    return
                if self.gate is not None:
                    self.gate.acquire(1, WAIT_S)
                elif not self.buffer.wait_for_room(self.AHEAD, WAIT_S):
                    return
                with self.lock:
                    (group,) = self.engine.generate(PROMPT, PARAMS)
                self.buffer.put([group])
        except GateClosed:
            return
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error.append(error)

    def sync(self, version: int) -> None:
        with self.lock:  # the round in flight finishes on the weights it started with
            self.engine.update_weights(self.weights[version % 2].items(), version=version)
        if self.gate is not None:
            self.gate.advance(version)

    def close(self) -> None:
        self.stop.set()
        self.buffer.close()
        if self.gate is not None:
            self.gate.close()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive() and not self.error


def test_drop_no_trained_token_is_older_than_k_while_the_engine_runs_ahead():
    k, steps = 1, 4
    pipeline = _Pipeline(k, gate=None)
    pipeline.thread.start()
    trained_ages: Counter[int] = Counter()
    try:
        for step in range(steps):
            pipeline.buffer.wait_for(_Pipeline.AHEAD, WAIT_S)  # the engine made 3 groups while the trainer trained one
            admission = pipeline.buffer.take(1, train_version=step, timeout_s=WAIT_S)
            assert len(admission.admitted) == 1
            for group in admission.admitted:
                trained_ages.update(token_ages(_token_versions(group), step))
            pipeline.sync(step + 1)
    finally:
        pipeline.close()
    assert max(trained_ages) <= k and sum(trained_ages.values()) > 0
    # 3 groups of version 0 before the first sync, steps 0 and 1 train one each: step 2 (version 2) drops the third
    assert pipeline.buffer.dropped >= 1


def test_a_producer_that_retakes_the_engine_at_once_cannot_starve_the_weight_sync():
    """CI (3.12): without the run-ahead bound the producer re-took the engine lock before the trainer's sync woke,
    made all its groups on version 0, and the trainer at version 2 found nothing admissible (120 s timeout)."""
    pipeline = _Pipeline(1, gate=None)
    pipeline.thread.start()
    try:
        pipeline.buffer.wait_for(_Pipeline.AHEAD, WAIT_S)
        pipeline.buffer.take(1, train_version=0, timeout_s=WAIT_S)
        pipeline.sync(1)  # the producer makes at most one more group meanwhile
        assert len(pipeline.buffer) <= _Pipeline.AHEAD
    finally:
        pipeline.close()


def test_a_closed_buffer_releases_a_producer_waiting_for_room():
    buffer: GroupBuffer[list[int]] = GroupBuffer(1, list)
    buffer.put([[0]])
    assert buffer.wait_for_room(2, 0.0)
    with pytest.raises(TimeoutError, match="1 group"):
        buffer.wait_for_room(1, 0.0)
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(buffer.wait_for_room(1, WAIT_S)))
    waiter.start()
    buffer.close()
    waiter.join(WAIT_S)
    assert results == [False]


def test_wait_the_producer_blocks_at_the_bound_and_nothing_is_dropped():
    k, steps = 1, 4
    gate = StalenessGate(max_staleness=k, groups_per_step=1)
    pipeline = _Pipeline(k, gate)
    pipeline.thread.start()
    trained_ages: Counter[int] = Counter()
    try:
        for step in range(steps):
            assert gate.blocked.wait(WAIT_S)  # the producer stopped itself at the bound ...
            assert len(pipeline.buffer) == (k + 1) * 1 and gate.capacity() == 0  # ... with (k + 1) G groups ahead
            admission = pipeline.buffer.take(1, train_version=step, timeout_s=WAIT_S)
            ages = token_ages(_token_versions(admission.admitted[0]), step)
            assert set(ages) == ({0} if step == 0 else {k})  # the oldest group ahead is exactly k behind
            trained_ages.update(ages)
            pipeline.sync(step + 1)  # clears the block; the producer starts the group the new version allows
    finally:
        pipeline.close()
    assert pipeline.buffer.dropped == 0 and max(trained_ages) == k
    assert gate.waits >= steps


def test_one_step_async_reports_its_tokens_by_age():
    """The scheduler's metrics count each sample's tokens at its version (tokens_of)."""
    from gspo_megatron.rollout.scheduler import RolloutScheduler

    batches = {0: [0, 0], 1: [0, 0]}  # both steps' samples were generated on version 0
    scheduler = RolloutScheduler(
        lambda step: (batches[step], {}),
        1,
        last_step=2,
        versions_of=lambda versions: versions,
        tokens_of=lambda _: [3, 2],
    )
    _, metrics = scheduler.take(1)
    assert metrics["async/stale_tokens_age_1"] == 5.0 and metrics["async/stale_token_frac"] == 1.0
    _, metrics = scheduler.take(0)
    assert metrics["async/stale_tokens_age_1"] == 0.0 and metrics["async/stale_token_frac"] == 0.0
