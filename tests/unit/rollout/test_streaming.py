"""Streaming asynchronous rollout with the real embedded engine: a fast producer and a trainer that steps only
once the producer has run as far ahead as the policy lets it (an event, not a clock). Under ``wait`` no group
passes the bound and the ages climb to k and stay there; under ``drop`` the producer runs further and the groups
past the bound are dropped at take, whole. The weights change at every sync, so each sample's version is the
engine's own."""

import threading

import pytest

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.config import EmbeddedConfig, StalenessMode
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.scheduler import StalenessError
from gspo_megatron.rollout.streaming import StreamingScheduler
from gspo_megatron.testing.model_fixtures import tiny_qwen3_moe_hf_config as _hf_config
from gspo_megatron.testing.model_fixtures import tiny_qwen3_moe_hf_weights as _weights

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=3, return_routed_experts=True)
BOUND_S = 120.0  # each wait's bound; the test never races it


def _versions(group):
    return [s.weight_version for s in group for _ in s.output_ids]


class _Run:
    """The real engine under a streaming scheduler; each round is one prompt's group (G = 1)."""

    def __init__(self, mode, max_staleness=2, steps=6, next_round=None, buffered=0, clock=None):
        self.engine = EmbeddedEngine(_hf_config(), EmbeddedConfig())
        self.rounds = []  # the round indices drawn, in order
        self.clock = clock
        self.scheduler = StreamingScheduler(
            self._draw,
            lambda step, groups: (groups, {}),
            _versions,
            lambda groups: [s.weight_version for group in groups for s in group],
            max_staleness,
            mode,
            groups_per_step=1,
            last_step=steps,
            wait_bound_s=BOUND_S,
            **({"clock": clock} if clock is not None else {}),
        )
        if next_round is not None:
            self.scheduler.load_state_dict({"next_round": next_round, "buffered_groups": buffered})

    def _draw(self, round_index):
        self.rounds.append(round_index)
        if self.clock is not None:
            self.clock.advance(ROUND_S)
        return self.engine.generate([[1 + round_index % 7, 2, 3]], PARAMS)

    def sync(self, version):
        self.scheduler.before_weight_sync()
        self.engine.update_weights(_weights(version).items(), version)
        self.scheduler.after_weight_sync(version)

    def train(self, first_step, steps):
        """Step by step: the producer has blocked (no capacity or room) before the trainer moves on -- under
        ``wait`` a sync gives it capacity, under ``drop`` a take gives it room."""
        scheduler, metrics = self.scheduler, []
        self.engine.update_weights(_weights(first_step).items(), first_step)
        scheduler.start(first_step)
        blocks = scheduler.wait_until_blocked(0, BOUND_S)
        for step in range(first_step, first_step + steps):
            groups, step_metrics = scheduler.take(step)
            assert len(groups) == 1
            metrics.append(step_metrics)
            if scheduler.mode is StalenessMode.drop:
                blocks = scheduler.wait_until_blocked(blocks, BOUND_S)
            self.sync(step + 1)
            if scheduler.mode is StalenessMode.wait:
                blocks = scheduler.wait_until_blocked(blocks, BOUND_S)
        scheduler.close()
        return metrics


def test_wait_holds_the_producer_at_the_gate_and_trains_every_group_within_k():
    run = _Run(StalenessMode.wait)
    metrics = run.train(0, 6)
    # k = 2, G = 1: rounds 0..2 start on version 0, then one round per sync; step s trains round s
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert [m["async/groups_dropped"] for m in metrics] == [0.0] * 6
    assert run.rounds == [0, 1, 2, 3, 4, 5]  # nothing past the last step, nothing dropped
    tokens = PARAMS.n * PARAMS.max_new_tokens  # no stop token in this vocabulary's sampling: full length
    assert [m["async/stale_tokens_age_2"] for m in metrics] == [0.0, 0.0] + [float(tokens)] * 4
    assert metrics[1]["async/stale_token_frac"] == 1.0 and metrics[0]["async/stale_token_frac"] == 0.0
    for m in metrics:
        assert 0.0 <= m["time/trainer_idle_frac"] <= 1.0 and 0.0 <= m["time/engine_idle_frac"] <= 1.0


class _ManualClock:
    """The idle fractions' time source, moved by hand: a round takes ``ROUND_S``, the trainer's work what the test
    says, so the fractions are exact whatever the machine's speed."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


ROUND_S = 10.0


def test_engine_idle_frac_is_each_steps_own_with_a_wait_in_progress_counted_up_to_the_take():
    """k = 2, G = 1 under wait: rounds 0..2 (30 s) then the gate holds the producer. Step 0 takes at 100: idle
    70 of its 100 s cycle, the wait still in progress. The sync lets round 3 run (10 s), the gate holds it again
    from 110; step 1 takes at 200: idle 90 of 100 -- its own, not the run's so far ((70 + 90) / 200)."""
    clock = _ManualClock()
    run = _Run(StalenessMode.wait, clock=clock)
    run.engine.update_weights(_weights(0).items(), 0)
    scheduler = run.scheduler
    scheduler.start(0)
    blocks = scheduler.wait_until_blocked(0, BOUND_S)
    clock.now = 100.0
    _, first = scheduler.take(0)
    run.sync(1)
    scheduler.wait_until_blocked(blocks, BOUND_S)
    clock.now = 200.0
    _, second = scheduler.take(1)
    scheduler.close()
    assert run.rounds == [0, 1, 2, 3]
    assert (first["time/engine_idle_frac"], second["time/engine_idle_frac"]) == (0.7, 0.9)
    assert (first["time/trainer_idle_frac"], second["time/trainer_idle_frac"]) == (0.0, 0.0)


def test_drop_runs_the_producer_ahead_and_drops_whole_groups_past_k():
    run = _Run(StalenessMode.drop)
    metrics = run.train(0, 6)
    # k = 2, G = 1: the buffer holds DROP_RUN_AHEAD (k + 1) G = 6 groups. Rounds 0..5 and (after take 0) 6 on
    # version 0, 7 on 1, 8 on 2; step 3 drops rounds 3..6 (age 3) and trains round 7 (age 2)
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert [m["async/groups_dropped"] for m in metrics] == [0.0, 0.0, 0.0, 4.0, 0.0, 0.0]
    assert metrics[3]["async/policy_version_min"] == 1.0
    assert run.scheduler.buffer.dropped == 4


def test_a_resumed_producer_starts_at_the_saved_round_and_counts_the_dropped_buffer():
    """The resume rule: the checkpoint's next round, the buffered groups counted as dropped at the first step."""
    run = _Run(StalenessMode.wait, steps=5, next_round=7, buffered=3)
    metrics = run.train(3, 2)
    assert run.rounds == [7, 8] and [m["async/staleness_max"] for m in metrics] == [0.0, 1.0]
    assert [m["async/groups_dropped_at_resume"] for m in metrics] == [3.0, 0.0]


def test_a_producer_failure_reaches_the_trainer():
    run = _Run(StalenessMode.wait)

    def broken(round_index):
        raise ValueError(f"round {round_index} broke")

    run.scheduler.draw_round = broken
    run.scheduler.start(0)
    with pytest.raises(RuntimeError, match="producer thread failed") as error:
        run.scheduler.take(0)
    assert "round 0 broke" in str(error.value.__cause__)
    run.scheduler.close()


def test_streaming_needs_a_bound_above_one():
    with pytest.raises(ValueError, match=r"rollout.max_staleness=1: streaming is for a bound above 1"):
        _Run(StalenessMode.wait, max_staleness=1)


def test_wait_refuses_a_group_its_gate_should_have_held():
    """The trainer's own check: a group past the bound under wait is a bug, not a drop."""
    run = _Run(StalenessMode.wait)
    run.engine.update_weights(_weights(0).items(), 0)
    run.scheduler.start(0)
    run.scheduler.wait_until_blocked(0, BOUND_S)
    run.sync(5)  # the weights jump five versions: rounds 0..2 (version 0) are too old at step 5
    with pytest.raises(StalenessError, match="under rollout.staleness_mode=wait"):
        run.scheduler.take(5)
    run.scheduler.close()


def test_a_weight_sync_waits_for_the_round_in_flight():
    """The sync's turn comes after the round that started on the old weights: its samples keep that version."""
    run = _Run(StalenessMode.wait)
    started, release, order = threading.Event(), threading.Event(), []

    def held_round(round_index):
        started.set()
        assert release.wait(BOUND_S)
        groups = run.engine.generate([[1, 2, 3]], PARAMS)
        order.append("round")
        return groups

    run.scheduler.draw_round = held_round
    run.engine.update_weights(_weights(0).items(), 0)
    run.scheduler.start(0)
    assert started.wait(BOUND_S)

    def sync():
        run.sync(1)
        order.append("sync")

    syncing = threading.Thread(target=sync)
    syncing.start()
    release.set()
    syncing.join(BOUND_S)
    assert order[:2] == ["round", "sync"]
    groups, _ = run.scheduler.take(1)
    assert [s.weight_version for g in groups for s in g] == [0, 0]  # generated on version 0, trained at 1
    run.scheduler.close()


class _TickingClock:
    """Each read one second after the last. Armed, it holds the producer thread's next read until the trainer (the
    main thread) has read it twice -- the take's reads around its wait for groups -- and that read lands
    ``HELD_S`` later, the time the take spent assembling its batch meanwhile. That forces the interleaving CI met
    under drop (tests/e2e/test_streaming_e2e.py, engine_idle_frac 1.019): the take frees room, and the producer's
    wait for it ends -- and is timed -- after the take has read its clock."""

    HELD_S = 100.0

    def __init__(self):
        self.now = 0.0
        self.changed = threading.Condition()
        self.trainer_reads: int | None = None  # None: not armed

    def arm(self):
        with self.changed:
            self.trainer_reads = 0

    def __call__(self):
        with self.changed:
            if self.trainer_reads is not None:
                if threading.current_thread() is threading.main_thread():
                    self.trainer_reads += 1
                    self.changed.notify_all()
                else:
                    assert self.changed.wait_for(lambda: self.trainer_reads >= 2, BOUND_S)
                    self.trainer_reads = None
                    self.now += self.HELD_S
            self.now += 1.0
            return self.now


def test_engine_idle_frac_counts_no_wait_past_the_end_of_its_cycle():
    """Under drop a take frees room and the producer's wait for it ends at once. A wait that ends after the take
    read its clock counted idle time past the cycle it was divided by (a fraction above 1); the take now reads
    the clock for both under the lock the producer's wait is recorded under. The take's assemble returns only
    once the producer has left its wait (it is drawing the next round)."""
    clock, drawing, release = _TickingClock(), threading.Event(), threading.Event()
    first_held = [None]  # the round the producer draws after the take freed room
    drawn = []

    def draw(round_index):
        if first_held[0] is not None and round_index >= first_held[0]:
            drawing.set()
            release.wait(BOUND_S)
        drawn.append(round_index)
        return [round_index]  # the round's one group (G = 1)

    def assemble(step, groups):
        assert drawing.wait(BOUND_S)
        return groups, {}

    scheduler = StreamingScheduler(
        draw,
        assemble,
        lambda group: [0],
        lambda groups: [0] * len(groups),
        2,
        StalenessMode.drop,
        groups_per_step=1,
        last_step=6,
        wait_bound_s=BOUND_S,
        clock=clock,
    )
    scheduler.start(0)
    scheduler.wait_until_blocked(0, BOUND_S)  # the buffer is full: the producer waits for room
    first_held[0] = len(drawn)
    clock.arm()
    try:
        _, metrics = scheduler.take(0)
    finally:
        release.set()
        scheduler.close()
    assert 0.0 <= metrics["time/engine_idle_frac"] <= 1.0, metrics
    assert 0.0 <= metrics["time/trainer_idle_frac"] <= 1.0, metrics
