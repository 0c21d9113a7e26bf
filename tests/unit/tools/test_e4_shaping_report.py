"""Study E4's report (tools/study_reports/e4_shaping_report.py) on hand-built runs: the run names it reads, the
pre-registered noise floor by hand, the collapse rule, and the verdict rules in each of their outcomes."""

import math
from pathlib import Path

import pytest

from gspo_megatron.core.run_dir import RunData
from study_reports.e4_shaping_report import (
    collapse_verdict,
    noise_floor,
    run_identity,
    shortening_verdict,
    study_files,
    summarize_arms,
)

PROMPTS = 256


def make_run(arm: str, seed: int, accuracy: float, length: float, warm_start: str = "w150") -> RunData:
    metrics = [{"step": 1, "reward/accuracy": 0.5, "response/length_mean": 30.0}]
    metrics.append({"step": 2, "eval/pass@1": accuracy, "eval/response_length": length, "reward/accuracy": 0.7})
    config = {"trainer": {"seed": seed, "eval_prompts": PROMPTS}}
    return RunData(Path(f"{warm_start}-{arm}_s{seed}"), "gspo", config, metrics)


def arms_of(spec: dict[str, tuple[float, float]]) -> list[RunData]:
    """4 seeds per arm; seed s nudges accuracy by s/1000 and length by s/100 so ranks are strict."""
    return [
        make_run(arm, seed, accuracy + seed / 1000, length + seed / 100)
        for arm, (accuracy, length) in spec.items()
        for seed in (1, 2, 3, 4)
    ]


def judged(spec: dict[str, tuple[float, float]]) -> dict:
    return study_files(arms_of(spec), {})[0]["judged"]["w150"]


def test_the_run_name_gives_warm_start_and_arm_and_the_config_the_seed():
    assert run_identity(make_run("step_grpo_reward", 3, 0.5, 30.0)) == ("w150", "step_grpo_reward", 3)
    with pytest.raises(ValueError, match="<warm start>-<arm>_s<seed>"):
        run_identity(RunData(Path("baseline_s1"), "gspo", {"trainer": {"seed": 1}}, []))


def test_the_noise_floor_is_two_standard_errors_never_below_the_sampling_of_the_prompts():
    # seeds: x = 0.6, 0.8 (s^2 = 0.02), y = 0.7, 0.7 (s = 0): 2 sqrt(0.02/2) = 0.2; sampling: p = 0.7,
    # 2 sqrt(0.7 x 0.3 / 256 x (1/2 + 1/2)) = 0.0573 -- the seeds' spread wins
    assert noise_floor([0.6, 0.8], [0.7, 0.7], PROMPTS) == pytest.approx(0.2)
    # no spread over seeds: the sampling floor
    assert noise_floor([0.7, 0.7], [0.7, 0.7], PROMPTS) == pytest.approx(2 * math.sqrt(0.21 / 256))


def test_a_run_collapses_below_half_the_vanilla_accuracy_of_its_seed():
    runs = [make_run("vanilla", 1, 0.8, 30.0), make_run("grsp_ascending", 1, 0.39, 20.0)]
    runs.append(make_run("baseline", 1, 0.4, 30.0))  # exactly half: not collapsed
    arms = summarize_arms(runs)["w150"]
    assert arms["grsp_ascending"]["collapses"] == 1 and arms["baseline"]["collapses"] == 0


def test_shortening_without_accuracy_cost_is_reproduced():
    result = judged({"vanilla": (0.7, 31.0), "baseline": (0.75, 30.0), "kimi_length": (0.75, 20.0)})["kimi_length"]
    assert result["vs_baseline"]["shorter"]["p"] == pytest.approx(1 / 70)  # 4 against 4, fully separated
    assert result["vs_baseline"]["length_change_pct"] < -30
    assert result["verdict"] == "reproduced"


def test_an_accuracy_cost_beyond_the_noise_floor_or_no_shortening_is_not_reproduced():
    costly = judged({"baseline": (0.75, 30.0), "kimi_length": (0.45, 20.0)})["kimi_length"]
    assert costly["reads_vs_baseline"]["costs_accuracy"]
    assert costly["verdict"] == "not reproduced"
    nil = judged({"baseline": (0.75, 30.0), "dapo_overlong": (0.75, 29.0)})["dapo_overlong"]  # -3.3%
    assert nil["verdict"] == "not reproduced"


def test_shorter_by_less_than_ten_percent_is_undetermined():
    result = judged({"baseline": (0.75, 30.0), "dapo_overlong": (0.75, 28.0)})["dapo_overlong"]  # -6.7%, p 1/70
    assert result["verdict"] == "undetermined at this power"


def test_grsp_ascending_collapse_verdict_in_each_outcome():
    assert collapse_verdict({"costs_accuracy": True, "keeps_accuracy": False}) == "reproduced"
    assert collapse_verdict({"costs_accuracy": False, "keeps_accuracy": True}) == "not reproduced"
    assert collapse_verdict({"costs_accuracy": False, "keeps_accuracy": False}) == "undetermined at this power"
    result = judged({"baseline": (0.75, 30.0), "grsp_ascending": (0.40, 30.0)})["grsp_ascending"]
    assert result["verdict"] == "reproduced"
    assert shortening_verdict({}) == "no data"


def test_step_grpo_is_read_against_the_papers_figure_from_the_vanilla_model():
    spec = {"vanilla": (0.7, 30.0), "baseline": (0.75, 28.0), "step_grpo_reward": (0.75, 26.0)}
    result = judged(spec)["step_grpo_reward"]
    assert result["vs_vanilla"]["length_change_pct"] == pytest.approx(100 * (26.025 / 30.025 - 1))  # -13.3%
    assert result["verdict_vs_paper_figure"] == "undetermined at this power"  # shorter, but not by 16%
    spec["step_grpo_reward"] = (0.75, 20.0)
    assert judged(spec)["step_grpo_reward"]["verdict_vs_paper_figure"] == "reproduced"
