"""Study E3's report (tools/study_reports/long_response_report.py) on hand-built runs: the collapse rule and
grad-norm spikes at their thresholds, the length arm read from the generation cap, the pre-registered exact
tests' p-values, and the verdict rule in each of its three outcomes."""

from pathlib import Path

import pytest

from gspo_megatron.core.run_dir import RunData
from study_reports.long_response_report import (
    collapse,
    grad_norm_spikes,
    length_arm,
    preregistered_tests,
    study_files,
    summarize_arms,
    verdict,
)

STEPS = 15  # the fewest a run needs: its first 5 and last 10 steps


def make_run(cap: int, algorithm: str, seed: int, reward_last: float, token_var: float, seq_var: float) -> RunData:
    bucket = "len_65_up" if cap > 64 else "len_17_64"
    metrics = [
        {
            "step": step,
            "reward/mean": 1.0 if step <= 5 else reward_last,
            f"loss/ratio_var_token/{bucket}": token_var,
            f"loss/ratio_var_seq/{bucket}": seq_var,
            "grad_norm": 1.0,
        }
        for step in range(1, STEPS + 1)
    ]
    config = {"rollout": {"max_new_tokens": cap}, "algorithm": {"name": algorithm}, "trainer": {"seed": seed}}
    return RunData(Path(f"{algorithm}_len{cap}_seed{seed}"), algorithm, config, metrics)


def study(long_grpo_reward: float, long_gspo_reward: float, long_grpo_token_var: float, long_gspo_seq_var=0.01):
    """4 seeds per (length, algorithm); each seed's numbers nudged by seed / 1000 so ranks are strict."""
    runs = []
    for seed in (1, 2, 3, 4):
        nudge = seed / 1000
        for algorithm in ("grpo_token_mean", "grpo_token_sum"):
            runs.append(make_run(224, algorithm, seed, long_grpo_reward + nudge, long_grpo_token_var + nudge, 0.5))
            runs.append(make_run(48, algorithm, seed, 0.9 + nudge, 0.1 + nudge, 0.05))
        runs.append(make_run(224, "gspo", seed, long_gspo_reward + nudge, 0.2, long_gspo_seq_var + nudge))
        runs.append(make_run(48, "gspo", seed, 0.9 - nudge, 0.1, 0.01 + nudge))
    return summarize_arms(runs)


def test_a_run_collapses_when_its_last_ten_steps_fall_below_half_its_first_five():
    assert collapse([1.0] * 5 + [0.49] * 10) == (1.0, pytest.approx(0.49), True)
    assert collapse([1.0] * 5 + [0.5] * 10)[2] is False  # R_last = 0.5 x R_first is not below it
    assert collapse([1.0] * 14) == (None, None, False)  # too short to judge


def test_a_spike_is_a_grad_norm_above_five_times_the_median_of_the_nonzero_ones():
    assert grad_norm_spikes([0.0, 0.0, 1.0, 1.0, 1.0, 5.1]) == 1  # the zeros do not pull the median down
    assert grad_norm_spikes([0.0, 1.0, 1.0, 1.0, 5.0]) == 0
    assert grad_norm_spikes([0.0, 0.0]) == 0


def test_the_length_arm_and_its_bucket_come_from_the_generation_cap():
    assert length_arm(make_run(224, "gspo", 1, 1.0, 0.0, 0.0)) == ("long", "len_65_up")
    assert length_arm(make_run(48, "gspo", 1, 1.0, 0.0, 0.0)) == ("short", "len_17_64")


def test_the_paper_reproduced_gives_exact_p_values_of_one_in_seventy():
    arms = study(long_grpo_reward=0.2, long_gspo_reward=0.9, long_grpo_token_var=3.0)
    results = preregistered_tests(arms)
    assert results["1_token_dispersion_grows"]["grpo_token_mean"]["p"] == pytest.approx(1 / 70)
    collapses = results["3_long_failure"]["grpo_token_mean"]["collapses"]
    assert collapses["collapses"] == [4, 0] and collapses["p"] == pytest.approx(1 / 70)
    assert results["3_long_failure"]["grpo_token_mean"]["reward_last"]["p"] == pytest.approx(1 / 70)
    assert results["4_short_failure"]["grpo_token_mean"]["collapses"]["p"] == pytest.approx(1.0)
    assert verdict(results, arms)["verdict"] == "reproduced"
    assert verdict(results, arms)["mechanism_verdict"] == "reproduced"


def test_gspo_no_better_on_long_answers_is_not_reproduced():
    arms = study(long_grpo_reward=0.9, long_gspo_reward=0.8, long_grpo_token_var=0.05)
    judged = verdict(preregistered_tests(arms), arms)
    assert judged["verdict"] == "not reproduced"
    assert judged["mechanism_verdict"] == "not reproduced"  # token dispersion lower on long answers


def test_the_right_direction_without_significance_is_undetermined():
    arms = study(
        long_grpo_reward=0.9, long_gspo_reward=0.9015, long_grpo_token_var=3.0
    )  # overlapping rewards, no collapse
    judged = verdict(preregistered_tests(arms), arms)
    assert judged["parts"]["3 GRPO fails on long answers, GSPO not"] is False
    assert judged["verdict"] == "undetermined at this power"


def test_gspo_sequence_dispersion_growing_past_twice_the_short_arm_is_not_bounded():
    arms = study(long_grpo_reward=0.2, long_gspo_reward=0.9, long_grpo_token_var=3.0, long_gspo_seq_var=0.5)
    judged = verdict(preregistered_tests(arms), arms)
    assert judged["parts"]["2 GSPO's sequence dispersion bounded"] is False
    assert judged["verdict"] == "undetermined at this power"


def test_the_report_names_every_test_and_arm():
    arms_runs = [
        make_run(cap, a, s, 0.9, 0.1, 0.01) for cap in (48, 224) for a in ("grpo_token_mean", "gspo") for s in (1, 2)
    ]
    document, markdown = study_files(arms_runs, {})
    assert set(document["arms"]) == {"short", "long"}
    assert "| 1 | grpo_token_mean: token ratio dispersion, long > short |" in markdown
    assert "| long | gspo | 2 | 0 |" in markdown


def test_means_are_exactly_rounded_so_every_python_regenerates_the_same_report():
    """The stored E3 report regenerated with 52 last-digit differences on Python 3.12 (its sum() of floats
    compensates, 3.11's does not) before its means used math.fsum."""
    from study_reports.long_response_report import _mean

    assert _mean([0.1] * 10) == 0.1
