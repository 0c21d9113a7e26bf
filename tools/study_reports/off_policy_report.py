"""Study E2's report (issue 67): GRPO, GRPO + R3, GSPO at 32 updates per rollout, a step-size control and an
on-policy reference -- final eval, reward level and collapses per run -- judged by the tests and the rule
``reports/e2_off_policy/README.md`` fixed before the runs.

Design decisions:
- An arm is read from the run's config, not its directory name: the algorithm (``algorithm.name``, with R3's
  preset shortened to ``grpo_r3``), the learning rate when it is not the main job's 1e-3 (``_lr3e-4``) and the
  updates per rollout (``_upr32``): ``grpo_upr32``, ``grpo_r3_upr32``, ``gspo_upr32``, ``grpo_lr3e-4_upr32``,
  ``grpo_upr1``; R3 set beside another preset adds ``_r3`` (``gspo_r3_upr32``, the amendment's arm).
  A seed is ``trainer.seed`` (it sets the prompt stream and the initial weights too).
- Pre-registered per run: E_final = ``eval/pass@1`` at the run's last step (``trainer.steps``; a run whose
  last eval is elsewhere has none); learned = E_final >= 0.4; R_last = the mean ``reward/mean`` over the last
  20 steps; R_peak = the highest mean over 10 consecutive steps; collapsed = R_last < 0.5 x R_peak; failed =
  not learned or collapsed. The issue's example (R_last < 0.5 x the first 10 steps' mean) is reported beside
  it, not tested: from random init the first steps' reward is ~0.03.
- When no run of any arm learned, the verdict is "undetermined at this power" whatever the rule's clauses say
  (E2 on Qwen3.5's shape fixed this before its runs): "R3 no better than GRPO" between arms that all fail to
  learn the task is no evidence about replay, only about the task at this power.
- The tests are exact and one-sided (``exact_tests.py``), 8 runs against 8; the verdict rule is README's.
  Means by ``math.fsum`` (``Stat.of(..., exact=True)``), so every Python writes the same report.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from gspo_megatron.core.run_dir import RunData
from study_reports.aggregate import Stat
from study_reports.exact_tests import fisher_greater, mann_whitney_greater
from study_reports.store import reported_provenance
from study_reports.table_cells import exact_test_cell, stat_cell

ALPHA = 0.05
LEARNED_EVAL = 0.4  # learned: E_final >= LEARNED_EVAL
COLLAPSE_FRACTION = 0.5  # collapsed: R_last < COLLAPSE_FRACTION x R_peak
FIRST_STEPS, LAST_STEPS, PEAK_WINDOW = 10, 20, 10
MAIN_JOB_LR = 1.0e-3  # an arm's name carries its lr only when it differs from this
FEWEST_FAILURES_TO_RESCUE = 2  # GRPO failing in fewer runs than this leaves nothing for replay to rescue
NOTHING_LEARNED = "no run of any arm learned the task (E_final >= 0.4 in none)"
ALGORITHM_SHORT = {"grpo_rollout_routing_replay": "grpo_r3"}
ROLLOUT_REPLAY = "rollout"  # routing.replay's value for R3
GRPO, R3, GSPO, GSPO_R3 = "grpo_upr32", "grpo_r3_upr32", "gspo_upr32", "gspo_r3_upr32"
STEP_SIZE_CONTROL, ON_POLICY = "grpo_lr3e-4_upr32", "grpo_upr1"
# summary name -> metrics.jsonl key (mean over the steps that logged it)
STEP_KEYS = {
    "reward_mean": "reward/mean",
    "clip_frac_token": "loss/clip_frac_token",
    "clip_frac_seq": "loss/clip_frac_seq",
    "grad_norm": "grad_norm",
    "update_changed_frac": "routing/update_changed_frac",
    "update_experts_changed_per_slot": "routing/update_experts_changed_per_slot",
}
NUMBERS = (*STEP_KEYS, "eval_final", "reward_first", "reward_last", "reward_peak")


def arm_name(config: dict) -> str:
    """``<algorithm>[_lr<lr>]_upr<updates per rollout>`` from the run's config."""
    algorithm = config["algorithm"]["name"]
    name = ALGORITHM_SHORT.get(algorithm, algorithm)
    if config.get("routing", {}).get("replay") == ROLLOUT_REPLAY and not name.endswith("_r3"):
        name += "_r3"  # R3 set beside another algorithm's preset (GSPO + R3: algorithm=gspo routing.replay=rollout)
    lr = float(config["optimizer"]["lr"])
    if not math.isclose(lr, MAIN_JOB_LR):
        mantissa, exponent = f"{lr:.0e}".split("e")
        name += f"_lr{mantissa}e{int(exponent)}"
    return f"{name}_upr{int(config['trainer']['updates_per_rollout'])}"


def _mean(values: Iterable[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else None


def rewards_by_step(run: RunData) -> list[float]:
    steps, values = run.metric_series("reward/mean")
    return [v for _, v in sorted(zip(steps, values, strict=True))]


def reward_levels(rewards: Sequence[float]) -> dict:
    """R_first (first 10 steps), R_last (last 20), R_peak (best 10-step window) and the two collapse rules."""
    if len(rewards) < LAST_STEPS + FIRST_STEPS:
        return dict.fromkeys(("reward_first", "reward_last", "reward_peak")) | {
            "collapsed": False,
            "collapsed_vs_first": False,
        }
    first = math.fsum(rewards[:FIRST_STEPS]) / FIRST_STEPS
    last = math.fsum(rewards[-LAST_STEPS:]) / LAST_STEPS
    peak = max(
        math.fsum(rewards[start : start + PEAK_WINDOW]) / PEAK_WINDOW for start in range(len(rewards) - PEAK_WINDOW + 1)
    )
    return {
        "reward_first": first,
        "reward_last": last,
        "reward_peak": peak,
        "collapsed": last < COLLAPSE_FRACTION * peak,
        "collapsed_vs_first": last < COLLAPSE_FRACTION * first,
    }


def final_eval(run: RunData) -> float | None:
    """``eval/pass@1`` at the run's last step (``trainer.steps``), else None."""
    last_step = int(run.config["trainer"]["steps"])
    steps, values = run.metric_series("eval/pass@1")
    return dict(zip(steps, values, strict=True)).get(last_step)


def summarize_run(run: RunData) -> dict:
    summary: dict = {"run": run.path.name, "seed": run.config["trainer"]["seed"]}
    for name, key in STEP_KEYS.items():
        summary[name] = _mean(run.metric_series(key)[1])
    summary["eval_final"] = final_eval(run)
    steps, values = run.metric_series("eval/pass@1")
    summary["eval_by_step"] = {str(step): value for step, value in zip(steps, values, strict=True)}
    summary.update(reward_levels(rewards_by_step(run)))
    summary["learned"] = summary["eval_final"] is not None and summary["eval_final"] >= LEARNED_EVAL
    summary["failed"] = not summary["learned"] or summary["collapsed"]
    return summary


def summarize_arms(runs: list[RunData]) -> dict[str, dict]:
    """{arm: {"runs": [...], "numbers": {name: Stat}, "learned": n, "collapses": n, "failures": n}}, stored order."""
    by_arm: dict[str, list[dict]] = {}
    for run in runs:
        by_arm.setdefault(arm_name(run.config), []).append(summarize_run(run))
    return {
        arm: {
            "runs": summaries,
            "numbers": {
                n: Stat.of((float(s[n]) for s in summaries if s[n] is not None), exact=True).to_dict() for n in NUMBERS
            },
            "learned": sum(1 for s in summaries if s["learned"]),
            "collapses": sum(1 for s in summaries if s["collapsed"]),
            "collapses_vs_first": sum(1 for s in summaries if s["collapsed_vs_first"]),
            "failures": sum(1 for s in summaries if s["failed"]),
        }
        for arm, summaries in by_arm.items()
    }


def _values(arms: dict, arm: str, name: str) -> list[float]:
    entry = arms.get(arm)
    return [] if entry is None else entry["numbers"][name]["values"]


def greater(arms: dict, x_arm: str, y_arm: str, name: str = "eval_final") -> dict:
    """One-sided exact Mann-Whitney, H1: ``x_arm``'s ``name`` tends to exceed ``y_arm``'s; medians beside it."""
    x, y = _values(arms, x_arm, name), _values(arms, y_arm, name)
    test: dict = {"x": x_arm, "y": y_arm, "number": name, "n": [len(x), len(y)]}
    if not x or not y:
        return {**test, "p": None, "median_x": None, "median_y": None}
    return {**test, "p": mann_whitney_greater(x, y), "median_x": statistics.median(x), "median_y": statistics.median(y)}


def fails_more(arms: dict, a_arm: str, b_arm: str) -> dict:
    """One-sided Fisher exact, H1: ``a_arm`` fails (not learned or collapsed) more often than ``b_arm``."""
    a, b = (arms.get(arm, {"runs": [], "failures": 0}) for arm in (a_arm, b_arm))
    n_a, n_b = len(a["runs"]), len(b["runs"])
    p = fisher_greater(a["failures"], n_a, b["failures"], n_b) if n_a and n_b else None
    return {"x": a_arm, "y": b_arm, "p": p, "failures": [a["failures"], b["failures"]], "n": [n_a, n_b]}


def preregistered_tests(arms: dict) -> dict:
    """The pre-registered tests (README), numbered as there."""
    return {
        "1_r3_eval_over_grpo": greater(arms, R3, GRPO),
        "2_grpo_fails_more_than_r3": fails_more(arms, GRPO, R3),
        "3_r3_reward_last_over_grpo": greater(arms, R3, GRPO, "reward_last"),
        "4_step_size_control_rescues": {
            "eval": greater(arms, STEP_SIZE_CONTROL, GRPO),
            "failures": fails_more(arms, GRPO, STEP_SIZE_CONTROL),
        },
        "5_on_policy_over_grpo": greater(arms, ON_POLICY, GRPO),
        "6_gspo": {"gspo_over_grpo": greater(arms, GSPO, GRPO), "r3_over_gspo": greater(arms, R3, GSPO)},
        "amendment_gspo_r3_over_gspo": greater(arms, GSPO_R3, GSPO),
        "step_size_r3_over_control": greater(arms, R3, STEP_SIZE_CONTROL),
    }


def _significant(test: dict) -> bool:
    return test["p"] is not None and test["p"] < ALPHA


def verdict(results: dict, arms: dict) -> dict:
    """README's rule for "GRPO needs Routing Replay at high off-policy pressure", and the step-size reading."""
    primary, failures = results["1_r3_eval_over_grpo"], results["2_grpo_fails_more_than_r3"]
    (grpo_failures, r3_failures), (grpo_runs, r3_runs) = failures["failures"], failures["n"]
    step_size = _significant(results["4_step_size_control_rescues"]["eval"]) and not _significant(
        results["step_size_r3_over_control"]
    )
    if primary["p"] is None:  # an arm without runs: nothing to judge
        return {"parts": {}, "verdict": "undetermined at this power", "effect_is_step_size": step_size}
    # "more runs" read as rates: the same with 8 runs a side, and fair when a cut-short study has 7 against 8
    grpo_fails_more = grpo_failures * r3_runs > r3_failures * grpo_runs
    parts = {
        "1 R3's final eval above GRPO's (significant)": _significant(primary),
        "GRPO fails in more runs than R3": grpo_fails_more,
        "GRPO fails in at least 2 runs": grpo_failures >= FEWEST_FAILURES_TO_RESCUE,
    }
    no_effect = primary["median_x"] <= primary["median_y"] and not grpo_fails_more
    if parts["1 R3's final eval above GRPO's (significant)"] and grpo_fails_more:
        outcome = "reproduced"
    elif no_effect or not parts["GRPO fails in at least 2 runs"]:
        outcome = "not reproduced"
    else:
        outcome = "undetermined at this power"
    if not any(entry["learned"] for entry in arms.values()):
        # reports/e2_qwen35_shape/README.md, fixed before its runs: the task not learned in any run of any arm
        # answers nothing about replay (the key appears only then, so E2's report stays as stored)
        parts[NOTHING_LEARNED] = True
        outcome = "undetermined at this power"
    return {"parts": parts, "verdict": outcome, "effect_is_step_size": step_size}


def _p(test: dict) -> str:
    return exact_test_cell(test, "failures", show_n=True)


def _test_rows(results: dict) -> list[str]:
    rows = [
        ("1 (primary)", "final eval: grpo_r3_upr32 > grpo_upr32", results["1_r3_eval_over_grpo"]),
        ("2", "failures: grpo_upr32 > grpo_r3_upr32", results["2_grpo_fails_more_than_r3"]),
        ("3", "R_last: grpo_r3_upr32 > grpo_upr32", results["3_r3_reward_last_over_grpo"]),
        ("4", "final eval: grpo_lr3e-4_upr32 > grpo_upr32", results["4_step_size_control_rescues"]["eval"]),
        ("4", "failures: grpo_upr32 > grpo_lr3e-4_upr32", results["4_step_size_control_rescues"]["failures"]),
        ("5", "final eval: grpo_upr1 > grpo_upr32", results["5_on_policy_over_grpo"]),
        ("6", "final eval: gspo_upr32 > grpo_upr32", results["6_gspo"]["gspo_over_grpo"]),
        ("6", "final eval: grpo_r3_upr32 > gspo_upr32", results["6_gspo"]["r3_over_gspo"]),
        ("step size", "final eval: grpo_r3_upr32 > grpo_lr3e-4_upr32", results["step_size_r3_over_control"]),
        ("amendment", "final eval: gspo_r3_upr32 > gspo_upr32", results["amendment_gspo_r3_over_gspo"]),
    ]
    return [f"| {number} | {comparison} | {_p(test)} |" for number, comparison, test in rows]


MARKDOWN_COLUMNS = (
    ("final eval", "eval_final"),
    ("R first 10", "reward_first"),
    ("R peak 10", "reward_peak"),
    ("R last 20", "reward_last"),
    ("R all steps", "reward_mean"),
    ("clip frac token", "clip_frac_token"),
    ("clip frac seq", "clip_frac_seq"),
    ("grad norm", "grad_norm"),
    ("expert sets changed / update", "update_changed_frac"),
    ("experts changed per slot / update", "update_experts_changed_per_slot"),
)


def render_markdown(arms: dict, results: dict, judged: dict) -> str:
    lines = ["# E2: a powered off-policy test (GRPO, GRPO + R3, GSPO at 32 updates per rollout)", ""]
    lines += ["## Verdict (rule fixed in README.md)", ""]
    lines += [f'- "GRPO needs Routing Replay at high off-policy pressure": **{judged["verdict"]}**']
    lines += [f"- {part}: {'yes' if held else 'no'}" for part, held in judged["parts"].items()]
    step_size = "yes" if judged["effect_is_step_size"] else "no"
    lines += [f"- the effect is step size (the lr 3e-4 control rescues GRPO as well as R3 does): {step_size}"]
    lines += ["", "## Tests (one-sided, exact)", "", "| test | comparison | result |", "|---|---|---|"]
    lines += _test_rows(results)
    lines += ["", "## Per arm (mean ± sample std over seeds; each run's numbers as README defines them)", ""]
    header = ["arm", "seeds", "learned", "collapses", "collapses vs first 10", "failures"]
    header += [name for name, _ in MARKDOWN_COLUMNS]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, entry in arms.items():
        counts = (entry["learned"], entry["collapses"], entry["collapses_vs_first"], entry["failures"])
        cells = [arm, str(len(entry["runs"])), *(str(c) for c in counts)]
        cells += [stat_cell(entry["numbers"][key]) for _, key in MARKDOWN_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Per run (learned: final eval >= 0.4; collapsed: R last < 0.5 x R peak)", ""]
    lines += ["| arm | seed | final eval | R peak | R last | collapsed |", "|---|---|---|---|---|---|"]
    for arm, entry in arms.items():
        for run in entry["runs"]:
            numbers = (run[k] for k in ("eval_final", "reward_peak", "reward_last"))
            cells = [arm, str(run["seed"]), *("--" if v is None else f"{v:.3g}" for v in numbers)]
            lines.append("| " + " | ".join([*cells, "yes" if run["collapsed"] else "no"]) + " |")
    return "\n".join(lines) + "\n"


def study_files(runs: list[RunData], manifests: dict) -> tuple[dict, str]:
    """(report.json's document, report.md's text) of the stored runs."""
    arms = summarize_arms(runs)
    results = preregistered_tests(arms)
    judged = verdict(results, arms)
    provenance = reported_provenance(manifests)
    document = {"verdict": judged, "tests": results, "arms": arms, "runs": provenance}
    return document, render_markdown(arms, results, judged)
