"""tools/async_report.py: the arms named from the runs' configs, the README's band around sync and each arm's
verdict, and the idle fractions and token ages pooled over the steps after the first -- on hand-built runs whose
numbers are checked by hand."""

from pathlib import Path

import pytest
from async_report import arm_of, report_of

from gspo_megatron.core.run_dir import RunData

STEPS, CYCLE_S, LENGTH, ROWS = 20, 2.0, 10.0, 128


def config(seed: int, k: int, engine: str = "embedded") -> dict:
    return {"trainer": {"seed": seed}, "rollout": {"async_rollout": k > 0, "max_staleness": k, "engine": engine}}


def records(reward: float, k: int) -> list[dict]:
    """A run's metrics: every step the same reward, a 2 s cycle, 128 rows of 10 tokens; sync generates for 1 s
    of it without overlap, streaming reports its own idle fractions and trains every token k versions old."""
    steps = []
    for step in range(1, STEPS + 1):
        record = {
            "step": step,
            "reward/mean": reward,
            "time/run_wall_s": CYCLE_S * step,
            "response/length_mean": LENGTH,
            "batch/fed_rows": float(ROWS),
        }
        if k == 0:
            record |= {"time/generation": 1.0, "time/generation_overlap_frac": 0.0}
        else:
            record |= {"time/trainer_idle_frac": 0.0, "time/engine_idle_frac": 0.25}
            record[f"async/stale_tokens_age_{k}"] = LENGTH * ROWS
        steps.append(record)
    return steps


def runs(rewards_by_arm: dict[int, list[float]]) -> list[RunData]:
    return [
        RunData(Path(f"k{k}_s{seed}"), "gspo", config(seed, k), records(reward, k))
        for k, rewards in rewards_by_arm.items()
        for seed, reward in enumerate(rewards, start=1)
    ]


def test_an_arm_is_its_schedule_and_its_engine_unless_embedded():
    assert [arm_of(config(1, 0)), arm_of(config(1, 2)), arm_of(config(1, 2, "sglang"))] == [
        "sync",
        "stream_k2",
        "stream_k2_sglang",
    ]
    one_step_off = config(1, 1)
    one_step_off["rollout"]["async_rollout"] = False  # max_staleness counts only with async_rollout
    assert arm_of(one_step_off) == "sync"


def test_the_band_is_twice_syncs_seed_std_and_each_arm_is_judged_by_its_mean():
    """sync R 0.5, 0.6, 0.7: mean 0.6, std 0.1, band 0.6 +- 0.2; k = 2 at 0.9 lies outside, k = 4 at 0.7 inside."""
    report = report_of(runs({0: [0.5, 0.6, 0.7], 2: [0.9, 0.9, 0.9], 4: [0.7, 0.7, 0.7]}), {})
    assert report["band"]["center"] == pytest.approx(0.6) and report["band"]["half_width"] == pytest.approx(0.2)
    k2, k4 = report["verdicts"]["stream_k2"], report["verdicts"]["stream_k4"]
    assert (k2["same_band"], k2["seeds_inside_band"]) == (False, 0)
    assert (k4["same_band"], k4["seeds_inside_band"]) == (True, 3)
    assert k2["difference_to_sync"] == pytest.approx(0.3)


def test_the_floor_holds_the_band_open_when_sync_seeds_agree():
    report = report_of(runs({0: [0.5, 0.5, 0.5], 2: [0.52, 0.52, 0.52]}), {})
    assert report["band"]["half_width"] == 0.03 and report["verdicts"]["stream_k2"]["same_band"]


def test_idle_fractions_and_ages_are_pooled_over_the_steps_after_the_first():
    """sync: 1 s of generation in a 2 s cycle, none overlapped -> trainer idle 0.5, engine idle 0.5; streaming: its
    own 0.0 and 0.25; k = 2's tokens all two versions old; 1280 tokens per 2 s."""
    arms = report_of(runs({0: [0.5, 0.6, 0.7], 2: [0.6, 0.6, 0.6]}), {})["arms"]
    sync, k2 = arms["sync"], arms["stream_k2"]
    assert sync["measured_steps"] == k2["measured_steps"] == 3 * (STEPS - 1)
    assert (sync["trainer_idle_frac"], sync["engine_idle_frac"]) == (0.5, 0.5)
    assert (k2["trainer_idle_frac"], k2["engine_idle_frac"]) == (0.0, 0.25)
    assert sync["tokens_by_age_frac"] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert k2["tokens_by_age_frac"] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert k2["trained_tokens_per_s"] == LENGTH * ROWS / CYCLE_S


def test_a_study_without_a_sync_arm_or_with_one_sync_seed_is_refused():
    with pytest.raises(ValueError, match="no sync run"):
        report_of(runs({2: [0.5, 0.6]}), {})
    with pytest.raises(ValueError, match="one seed"):
        report_of(runs({0: [0.5], 2: [0.5]}), {})
