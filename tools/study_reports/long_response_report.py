"""Study E3's report (issue 67): GRPO (token-mean, token-sum) vs GSPO on long and short answers -- ratio
dispersion in the arm's length bucket, clip fractions, grad-norm spikes, collapses -- judged by the tests and
the rule ``reports/e3_long_responses/README.md`` fixed before the runs.

Design decisions:
- An arm is (length, algorithm): the length arm is read from the run's generation cap
  (``rollout.max_new_tokens`` > 64: "long", whose responses fall in the ``len_65_up`` bucket; else "short",
  ``len_17_64``), the algorithm from ``algorithm.name``. A seed is ``trainer.seed``.
- A run is summarised by means over its steps (a key absent at a step, e.g. an empty bucket, is left out);
  R_first and R_last are the means of ``reward/mean`` over the first 5 and the last 10 steps, and a run
  *collapsed* when R_last < 0.5 x R_first (pre-registered).
- A grad-norm *spike* is a step whose ``grad_norm`` exceeds 5 x the median of the run's nonzero grad norms
  (a step where every group had zero advantage has grad norm 0 and is not a step the median should see).
- The tests are exact and one-sided (``exact_tests.py``: Mann-Whitney and Fisher by enumeration), four
  runs against four; the verdict needs all of its parts (README's rule), so the parts are not corrected for
  multiplicity.
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
COLLAPSE_FRACTION = 0.5  # collapsed: R_last < COLLAPSE_FRACTION x R_first
FIRST_STEPS, LAST_STEPS = 5, 10
SPIKE_FACTOR = 5.0  # a spike: grad_norm > SPIKE_FACTOR x the run's median nonzero grad_norm
BOUNDED_FACTOR = 2.0  # GSPO's D_seq stays bounded: not significant, or long's median within 2x short's
SHORT_CAP_MAX = 64  # a generation cap at most this is the short arm
GRPO, GRPO_SUM, GSPO = "grpo_token_mean", "grpo_token_sum", "gspo"
# summary name -> metrics.jsonl key (mean over the run's steps); {bucket} is the arm's length bucket
STEP_KEYS = {
    "reward": "reward/mean",
    "ratio_var_token": "loss/ratio_var_token/{bucket}",
    "ratio_var_seq": "loss/ratio_var_seq/{bucket}",
    "ratio_token_seq_gap": "loss/ratio_token_seq_gap",
    "clip_frac_token": "loss/clip_frac_token",
    "clip_frac_seq": "loss/clip_frac_seq",
    "grad_norm": "grad_norm",
    "response_length": "response/length_mean",
    "truncated_frac": "response/truncated_frac",
}


def length_arm(run: RunData) -> tuple[str, str]:
    """("long" | "short", the ratio-dispersion bucket its responses fall in)."""
    cap = int(run.config["rollout"]["max_new_tokens"])
    return ("short", "len_17_64") if cap <= SHORT_CAP_MAX else ("long", "len_65_up")


def _finite(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _mean(values: Iterable[float | None]) -> float | None:
    finite = _finite(values)
    return math.fsum(finite) / len(finite) if finite else None


def rewards_by_step(run: RunData) -> list[float]:
    steps, values = run.metric_series("reward/mean")
    return [v for _, v in sorted(zip(steps, values, strict=True))]


def collapse(rewards: Sequence[float]) -> tuple[float | None, float | None, bool]:
    """(R_first: mean of the first 5 steps, R_last: mean of the last 10, R_last < 0.5 x R_first)."""
    if len(rewards) < FIRST_STEPS + LAST_STEPS:
        return None, None, False
    first = math.fsum(rewards[:FIRST_STEPS]) / FIRST_STEPS
    last = math.fsum(rewards[-LAST_STEPS:]) / LAST_STEPS
    return first, last, last < COLLAPSE_FRACTION * first


def grad_norm_spikes(grad_norms: Sequence[float]) -> int:
    """Steps with grad_norm > 5 x the median of the nonzero grad norms."""
    nonzero = [g for g in grad_norms if g > 0 and math.isfinite(g)]
    if not nonzero:
        return 0
    median = statistics.median(nonzero)
    return sum(1 for g in nonzero if g > SPIKE_FACTOR * median)


def summarize_run(run: RunData) -> dict:
    arm, bucket = length_arm(run)
    summary: dict = {"run": run.path.name, "seed": run.config["trainer"]["seed"], "bucket": bucket}
    for name, key in STEP_KEYS.items():
        summary[name] = _mean(run.metric_series(key.format(bucket=bucket))[1])
    summary["reward_first"], summary["reward_last"], summary["collapsed"] = collapse(rewards_by_step(run))
    summary["grad_norm_spikes"] = grad_norm_spikes(run.metric_series("grad_norm")[1])
    return summary


def summarize_arms(runs: list[RunData]) -> dict[str, dict[str, dict]]:
    """{length arm: {algorithm: {"runs": [...], "numbers": {name: Stat}, "collapses": n}}}, in stored order."""
    arms: dict[str, dict[str, list[dict]]] = {}
    for run in runs:
        arms.setdefault(length_arm(run)[0], {}).setdefault(run.config["algorithm"]["name"], []).append(
            summarize_run(run)
        )
    names = [*STEP_KEYS, "reward_first", "reward_last", "grad_norm_spikes"]
    return {
        arm: {
            algorithm: {
                "runs": summaries,
                "numbers": {
                    n: Stat.of((float(s[n]) for s in summaries if s[n] is not None), exact=True).to_dict()
                    for n in names
                },
                "collapses": sum(1 for s in summaries if s["collapsed"]),
            }
            for algorithm, summaries in by_algorithm.items()
        }
        for arm, by_algorithm in arms.items()
    }


def greater(x: Sequence[float], y: Sequence[float]) -> dict:
    """One-sided exact Mann-Whitney, H1: x tends to exceed y; medians beside it."""
    x, y = _finite(x), _finite(y)
    if not x or not y:
        return {"p": None, "median_x": None, "median_y": None, "n": [len(x), len(y)]}
    p = mann_whitney_greater(x, y)
    return {"p": p, "median_x": statistics.median(x), "median_y": statistics.median(y), "n": [len(x), len(y)]}


def more_collapses(a: int, n_a: int, b: int, n_b: int) -> dict:
    """One-sided Fisher exact, H1: arm a collapses more often than arm b."""
    p = fisher_greater(a, n_a, b, n_b) if n_a and n_b else None
    return {"p": p, "collapses": [a, b], "n": [n_a, n_b]}


def _values(arms: dict, arm: str, algorithm: str, name: str) -> list[float]:
    entry = arms.get(arm, {}).get(algorithm)
    return [] if entry is None else entry["numbers"][name]["values"]


def _significant(test: dict) -> bool:
    return test["p"] is not None and test["p"] < ALPHA


def failure_tests(arms: dict, arm: str, grpo: str) -> dict:
    """Test 3 (long arm) / 4 (short arm): more collapses under GRPO than GSPO; GSPO's R_last higher."""
    grpo_runs, gspo_runs = (arms.get(arm, {}).get(a, {"runs": [], "collapses": 0}) for a in (grpo, GSPO))
    return {
        "collapses": more_collapses(
            grpo_runs["collapses"], len(grpo_runs["runs"]), gspo_runs["collapses"], len(gspo_runs["runs"])
        ),
        "reward_last": greater(_values(arms, arm, GSPO, "reward_last"), _values(arms, arm, grpo, "reward_last")),
    }


def preregistered_tests(arms: dict) -> dict:
    """The pre-registered tests (README), each with its p-value and the medians it compares."""
    return {
        "1_token_dispersion_grows": {
            a: greater(_values(arms, "long", a, "ratio_var_token"), _values(arms, "short", a, "ratio_var_token"))
            for a in (GRPO, GRPO_SUM)
        },
        "2_gspo_sequence_dispersion_grows": greater(
            _values(arms, "long", GSPO, "ratio_var_seq"), _values(arms, "short", GSPO, "ratio_var_seq")
        ),
        "3_long_failure": {a: failure_tests(arms, "long", a) for a in (GRPO, GRPO_SUM)},
        "4_short_failure": {a: failure_tests(arms, "short", a) for a in (GRPO, GRPO_SUM)},
    }


def _bounded(test: dict) -> bool:
    if test["p"] is None:
        return False
    return not _significant(test) or test["median_x"] <= BOUNDED_FACTOR * test["median_y"]


def verdict(results: dict, arms: dict) -> dict:
    """README's rule, for GRPO token-mean against GSPO."""
    dispersion = results["1_token_dispersion_grows"][GRPO]
    long_failure, short_failure = results["3_long_failure"][GRPO], results["4_short_failure"][GRPO]
    parts = {
        "1 token dispersion grows with length": _significant(dispersion),
        "2 GSPO's sequence dispersion bounded": _bounded(results["2_gspo_sequence_dispersion_grows"]),
        "3 GRPO fails on long answers, GSPO not": any(_significant(t) for t in long_failure.values()),
        "4 not on short answers": not any(_significant(t) for t in short_failure.values()),
    }
    grpo_long, gspo_long = (arms.get("long", {}).get(a) for a in (GRPO, GSPO))
    wrong_direction = (
        grpo_long is not None
        and gspo_long is not None
        and long_failure["reward_last"]["p"] is not None
        and long_failure["reward_last"]["median_x"] <= long_failure["reward_last"]["median_y"]
        and grpo_long["collapses"] <= gspo_long["collapses"]
    )
    if all(parts.values()):
        outcome = "reproduced"
    elif wrong_direction:
        outcome = "not reproduced"
    else:
        outcome = "undetermined at this power"
    mechanism_wrong = dispersion["p"] is not None and dispersion["median_x"] <= dispersion["median_y"]
    mechanism = (
        "reproduced"
        if parts["1 token dispersion grows with length"] and parts["2 GSPO's sequence dispersion bounded"]
        else "not reproduced"
        if mechanism_wrong
        else "undetermined at this power"
    )
    return {"parts": parts, "verdict": outcome, "mechanism_verdict": mechanism}


def _p(test: dict) -> str:
    return exact_test_cell(test, "collapses")


MARKDOWN_COLUMNS = (
    ("R first 5", "reward_first"),
    ("R last 10", "reward_last"),
    ("token ratio disp. E[(w-1)^2]", "ratio_var_token"),
    ("seq ratio disp. E[(s-1)^2]", "ratio_var_seq"),
    ("mean abs(w - s)", "ratio_token_seq_gap"),
    ("clip frac token", "clip_frac_token"),
    ("clip frac seq", "clip_frac_seq"),
    ("grad norm", "grad_norm"),
    ("grad-norm spikes", "grad_norm_spikes"),
    ("length", "response_length"),
    ("truncated", "truncated_frac"),
)


def render_markdown(arms: dict, results: dict, judged: dict) -> str:
    lines = [
        "# E3: long responses (GRPO token-mean, GRPO token-sum, GSPO)",
        "",
        "## Verdict (rule fixed in README.md)",
        "",
    ]
    overall, mechanism = judged["verdict"], judged["mechanism_verdict"]
    lines += [f"- overall: **{overall}**; the mechanism alone (tests 1 and 2): **{mechanism}**"]
    lines += [f"- {part}: {'yes' if held else 'no'}" for part, held in judged["parts"].items()]
    lines += ["", "## Tests (one-sided, exact)", "", "| test | comparison | result |", "|---|---|---|"]
    for algorithm, test in results["1_token_dispersion_grows"].items():
        lines.append(f"| 1 | {algorithm}: token ratio dispersion, long > short | {_p(test)} |")
    bounded = _p(results["2_gspo_sequence_dispersion_grows"])
    lines.append(f"| 2 | gspo: sequence ratio dispersion, long > short | {bounded} |")
    for number, arm in (("3", "long"), ("4", "short")):
        for algorithm, pair in results[f"{number}_{arm}_failure"].items():
            lines.append(f"| {number} | {arm}: {algorithm} collapses more than gspo | {_p(pair['collapses'])} |")
            lines.append(f"| {number} | {arm}: gspo's R_last > {algorithm}'s | {_p(pair['reward_last'])} |")
    lines += ["", "## Per arm (mean ± sample std over seeds; each run the mean over its steps)", ""]
    header = ["length", "algorithm", "seeds", "collapses", *(name for name, _ in MARKDOWN_COLUMNS)]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, by_algorithm in arms.items():
        for algorithm, entry in by_algorithm.items():
            cells = [arm, algorithm, str(len(entry["runs"])), str(entry["collapses"])]
            cells += [stat_cell(entry["numbers"][key]) for _, key in MARKDOWN_COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def study_files(runs: list[RunData], manifests: dict) -> tuple[dict, str]:
    """(report.json's document, report.md's text) of the stored runs."""
    arms = summarize_arms(runs)
    results = preregistered_tests(arms)
    judged = verdict(results, arms)
    provenance = reported_provenance(manifests)
    document = {"verdict": judged, "tests": results, "arms": arms, "runs": provenance}
    return document, render_markdown(arms, results, judged)
