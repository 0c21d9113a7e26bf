"""Study E2's report (tools/study_reports/off_policy_report.py) on hand-built runs: the arm read from the config,
the collapse and learned rules at their thresholds, the pre-registered exact tests' p-values, and the verdict
rule in each of its outcomes, with the step-size reading."""

from pathlib import Path

import pytest

from gspo_megatron.core.run_dir import RunData
from study_reports.off_policy_report import (
    arm_name,
    final_eval,
    preregistered_tests,
    reward_levels,
    study_files,
    summarize_arms,
    verdict,
)

STEPS = 30  # the fewest a run needs: its first 10 and last 20 steps
ARMS = {  # arm -> (algorithm.name, optimizer.lr, trainer.updates_per_rollout), as tools/e2_off_policy.sh sets them
    "grpo_upr32": ("grpo", 1.0e-3, 32),
    "grpo_r3_upr32": ("grpo_rollout_routing_replay", 1.0e-3, 32),
    "gspo_upr32": ("gspo", 1.0e-3, 32),
    "grpo_lr3e-4_upr32": ("grpo", 3.0e-4, 32),
    "grpo_upr1": ("grpo", 1.0e-3, 1),
    "gspo_r3_upr32": ("gspo", 1.0e-3, 32),  # with routing.replay=rollout
}


def config(arm: str, seed: int) -> dict:
    algorithm, lr, updates = ARMS[arm]
    trainer = {"seed": seed, "steps": STEPS, "updates_per_rollout": updates}
    routing = {"replay": "rollout" if arm.startswith(("grpo_r3", "gspo_r3")) else "none"}
    return {"algorithm": {"name": algorithm}, "optimizer": {"lr": lr}, "trainer": trainer, "routing": routing}


def make_run(arm: str, seed: int, eval_final: float, reward_last: float = 0.8) -> RunData:
    """Reward 0.8 for the first 10 steps, ``reward_last`` after; eval at steps 20 and 30 (the last)."""
    metrics: list[dict] = [{"step": s, "reward/mean": 0.8 if s <= 10 else reward_last} for s in range(1, STEPS + 1)]
    metrics[19]["eval/pass@1"] = 0.0
    metrics[STEPS - 1]["eval/pass@1"] = eval_final
    return RunData(Path(f"{arm}_seed{seed}"), ARMS[arm][0], config(arm, seed), metrics)


def study(eval_by_arm: dict[str, float]) -> dict:
    """8 seeds per arm; each seed's eval nudged by seed / 1000 so ranks are strict."""
    return summarize_arms(
        [make_run(arm, seed, value + seed / 1000) for seed in range(1, 9) for arm, value in eval_by_arm.items()]
    )


def test_the_arm_is_read_from_algorithm_lr_and_updates_per_rollout():
    assert [arm_name(config(arm, 1)) for arm in ARMS] == list(ARMS)


def test_a_run_collapses_when_its_last_twenty_steps_fall_below_half_its_best_ten():
    rising_then_falling = [0.1] * 10 + [1.0] * 10 + [0.49] * 20
    levels = reward_levels(rising_then_falling)
    assert levels["reward_peak"] == pytest.approx(1.0) and levels["collapsed"] is True
    assert levels["collapsed_vs_first"] is False  # 0.49 is not below half the first ten steps' 0.1
    assert reward_levels([0.1] * 10 + [1.0] * 10 + [0.5] * 20)["collapsed"] is False  # exactly half: not below
    assert reward_levels([1.0] * 29)["reward_last"] is None  # too short to judge


def test_the_final_eval_is_the_one_at_the_last_step_only():
    run = make_run("grpo_upr32", 1, eval_final=0.5)
    assert final_eval(run) == 0.5
    run.metrics[STEPS - 1].pop("eval/pass@1")
    assert final_eval(run) is None  # the step-20 eval does not stand in for it


def test_learned_is_a_final_eval_of_at_least_point_four():
    arms = summarize_arms([make_run("grpo_upr32", 1, 0.4), make_run("grpo_upr32", 2, 0.39)])
    assert [run["learned"] for run in arms["grpo_upr32"]["runs"]] == [True, False]
    assert arms["grpo_upr32"]["failures"] == 1


def test_replay_rescuing_grpo_is_reproduced_with_p_of_one_in_12870():
    arms = study(
        {"grpo_upr32": 0.1, "grpo_r3_upr32": 0.6, "gspo_upr32": 0.5, "grpo_lr3e-4_upr32": 0.1, "grpo_upr1": 0.0}
    )
    results = preregistered_tests(arms)
    assert results["1_r3_eval_over_grpo"]["p"] == pytest.approx(1 / 12870)
    assert results["2_grpo_fails_more_than_r3"]["failures"] == [8, 0]
    assert results["2_grpo_fails_more_than_r3"]["p"] == pytest.approx(1 / 12870)
    judged = verdict(results, arms)
    assert judged["verdict"] == "reproduced" and judged["effect_is_step_size"] is False


def test_a_smaller_step_rescuing_grpo_as_well_as_replay_says_the_effect_is_step_size():
    arms = study({"grpo_upr32": 0.1, "grpo_r3_upr32": 0.6, "grpo_lr3e-4_upr32": 0.6015})
    judged = verdict(preregistered_tests(arms), arms)
    assert judged["verdict"] == "reproduced" and judged["effect_is_step_size"] is True


def test_replay_no_better_than_grpo_is_not_reproduced():
    arms = study({"grpo_upr32": 0.1, "grpo_r3_upr32": 0.09, "grpo_lr3e-4_upr32": 0.5})  # the task is learnable
    assert verdict(preregistered_tests(arms), arms)["verdict"] == "not reproduced"


def test_no_run_of_any_arm_learning_is_undetermined_not_a_verdict_on_replay():
    arms = study({"grpo_upr32": 0.1, "grpo_r3_upr32": 0.09, "grpo_lr3e-4_upr32": 0.39})  # every run below 0.4
    judged = verdict(preregistered_tests(arms), arms)
    assert judged["verdict"] == "undetermined at this power"  # the clauses alone would say "not reproduced"
    assert judged["parts"]["no run of any arm learned the task (E_final >= 0.4 in none)"] is True
    runs = [
        make_run(arm, s, value + s / 1000)
        for s in range(1, 5)
        for arm, value in (("grpo_upr32", 0.1), ("grpo_r3_upr32", 0.09))
    ]
    one_learned = summarize_arms([*runs, make_run("grpo_lr3e-4_upr32", 1, 0.4)])  # one run of one arm learned
    judged = verdict(preregistered_tests(one_learned), one_learned)
    assert judged["verdict"] == "not reproduced"  # the rule's clauses apply again
    assert "no run of any arm learned the task (E_final >= 0.4 in none)" not in judged["parts"]


def test_grpo_failing_in_at_most_one_run_leaves_nothing_to_rescue():
    runs = [make_run("grpo_upr32", seed, 0.5 + seed / 1000) for seed in range(1, 8)]
    runs += [make_run("grpo_upr32", 8, 0.3)] + [make_run("grpo_r3_upr32", s, 0.9 + s / 1000) for s in range(1, 9)]
    arms = summarize_arms(runs)
    judged = verdict(preregistered_tests(arms), arms)
    assert judged["parts"]["1 R3's final eval above GRPO's (significant)"] is True
    assert judged["verdict"] == "reproduced"  # the rule's first clause: significant and more failures (1 vs 0)
    arms["grpo_upr32"]["runs"][7]["failed"], arms["grpo_upr32"]["failures"] = False, 0
    assert verdict(preregistered_tests(arms), arms)["verdict"] == "not reproduced"  # no GRPO failure at all


def test_the_right_direction_without_significance_is_undetermined():
    runs = [make_run("grpo_upr32", s, 0.3 + s / 100) for s in range(1, 9)]
    runs += [make_run("grpo_r3_upr32", s, 0.305 + s / 100) for s in range(1, 9)]  # interleaved with GRPO's
    arms = summarize_arms(runs)
    judged = verdict(preregistered_tests(arms), arms)
    assert judged["parts"]["1 R3's final eval above GRPO's (significant)"] is False
    assert judged["verdict"] == "undetermined at this power"


def test_the_report_names_every_test_and_arm():
    runs = [make_run(arm, seed, 0.5) for arm in ARMS for seed in (1, 2)]
    document, markdown = study_files(runs, {})
    assert list(document["arms"]) == list(ARMS)
    assert "| 1 (primary) | final eval: grpo_r3_upr32 > grpo_upr32 |" in markdown
    assert "| grpo_lr3e-4_upr32 | 2 | 2 | 0 | 0 | 0 |" in markdown


def test_a_cut_short_study_compares_failure_rates_and_an_absent_arm_is_undetermined():
    runs = [make_run("grpo_upr32", s, 0.1 + s / 1000) for s in range(1, 8)]  # 7 GRPO runs: all fail
    runs += [make_run("grpo_r3_upr32", s, 0.6 + s / 1000) for s in range(1, 9)]  # 8 R3 runs: none fails
    arms = summarize_arms(runs)
    results = preregistered_tests(arms)
    assert results["2_grpo_fails_more_than_r3"]["n"] == [7, 8]
    assert verdict(results, arms)["verdict"] == "reproduced"
    only_grpo = summarize_arms(runs[:7])
    assert verdict(preregistered_tests(only_grpo), only_grpo)["verdict"] == "undetermined at this power"
