"""tools/bench_async.py's measured steps and table on hand-built metrics records (its smoke run, which trains,
is in test_bench_smoke.py)."""

from __future__ import annotations

import pytest
from bench_async import ARMS, StepSample, arm_overrides, rotated, step_samples, table


def record(wall: float, length: float, rows: float, **extra: float) -> dict:
    return {"time/run_wall_s": wall, "response/length_mean": length, "batch/fed_rows": rows, **extra}


def test_sync_and_one_step_idle_time_comes_from_the_generation_and_its_overlap():
    records = [
        record(1.0, 5.0, 4.0, **{"time/generation": 0.5, "time/generation_overlap_frac": 0.0}),
        record(3.0, 10.0, 4.0, **{"time/generation": 0.5, "time/generation_overlap_frac": 0.25}),
    ]
    (sample,) = step_samples("one_step", records, warmup=1)
    assert sample.cycle_s == 2.0  # 3.0 - 1.0
    assert sample.trained_tokens == 40.0  # 10 x 4
    assert sample.trainer_idle_s == 0.375  # 0.5 x (1 - 0.25)
    assert sample.engine_idle_s == 1.5  # 2.0 - 0.5
    assert sample.tokens_by_age == (40.0, 0.0, 0.0, 0.0, 0.0)


def test_streaming_steps_read_the_schedulers_idle_fractions_and_token_ages():
    streaming = {"time/trainer_idle_frac": 0.1, "time/engine_idle_frac": 0.5, "async/stale_tokens_age_2": 30.0}
    records = [record(0.0, 1.0, 1.0), record(1.0, 1.0, 1.0), record(5.0, 20.0, 2.0, **streaming)]
    (sample,) = step_samples("stream_k2", records, warmup=2)  # the first two steps not measured
    assert (sample.cycle_s, sample.trainer_idle_s, sample.engine_idle_s) == (4.0, 0.4, 2.0)
    assert sample.tokens_by_age == (10.0, 0.0, 30.0, 0.0, 0.0)


def test_the_table_rates_each_arm_against_sync_over_its_pooled_steps():
    samples = [
        StepSample("sync", 2.0, 100.0, 1.0, 1.0, (100.0, 0, 0, 0, 0)),
        StepSample("sync", 2.0, 100.0, 1.0, 0.0, (100.0, 0, 0, 0, 0)),
        StepSample("stream_k2", 1.0, 150.0, 0.0, 0.5, (50.0, 100.0, 0, 0, 0)),
    ]
    lines = table(samples, ["sync", "stream_k2"]).splitlines()
    sync, stream = lines[1].split(), lines[2].split()
    assert sync[1:6] == ["2", "50.0", "1.00x", "0.500", "0.250"]  # 200 tokens / 4 s; idle 2/4 and 1/4
    assert stream[1:9] == ["1", "150.0", "3.00x", "0.000", "0.500", "0.333", "0.667", "0.000"]
    with pytest.raises(ValueError, match="arm 'one_step' has no measured step"):
        table(samples, ["sync", "one_step"])


def test_arms_rotate_and_only_streaming_arms_take_the_mode():
    arms = list(ARMS)
    for place in range(len(arms)):
        assert sorted(rotated(arms, rep)[place] for rep in range(len(arms))) == sorted(arms)
    assert "rollout.staleness_mode=drop" in arm_overrides("stream_k4", "drop")
    assert not any("staleness_mode" in o for o in arm_overrides("one_step", "drop"))
