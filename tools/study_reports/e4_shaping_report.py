"""Study E4's report (issue 67): length shaping against the papers' comparisons -- sampled evaluation accuracy
and length per arm and warm start, judged by the noise floor, the exact tests and the rule that
``reports/e4_shaping/README.md`` fixed before the runs.

Design decisions:
- A run is named ``<warm start>-<arm>_s<seed>`` (``tools/e4_shaping_study.sh`` sets Hydra's sweep subdir so);
  the arm and the warm start are read from the name, the seed from ``trainer.seed``.
- A run's A and L are ``eval/pass@1`` and ``eval/response_length`` of its last evaluation (the only one: the
  study evaluates at the last step, 256 sampled prompts); the ``vanilla`` arm is the warm start evaluated
  the same way (one update at lr 1e-12), so its A and L are A_0 and L_0.
- Noise floor of a difference of two arms' mean accuracies (pre-registered):
      NF = 2 max( sqrt(s_x^2/n_x + s_y^2/n_y), sqrt(p (1 - p) / P (1/n_x + 1/n_y)) ),
  s the sample std over seeds, p the pooled mean accuracy, P the evaluation prompts per run: two standard
  errors of the difference, never below what sampling P prompts alone gives.
- Tests are one-sided exact Mann-Whitney (``exact_tests.py``), run sets against run sets, alpha 0.05, no
  correction (each verdict reads its own two tests). Means and spreads are ``math.fsum`` based
  (``Stat.of(..., exact=True)``), so the report is bit-identical on Python 3.11 and 3.12.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from gspo_megatron.core.run_dir import RunData
from study_reports.aggregate import Stat
from study_reports.exact_tests import fisher_greater, mann_whitney_greater
from study_reports.store import reported_provenance
from study_reports.table_cells import stat_cell

ALPHA = 0.05
SHORTER_BY_PCT = 10.0  # "shortens": mean L at least this much below the comparison's (and significant)
NIL_PCT = 5.0  # "not reproduced": mean L less than this much below the comparison's
PAPER_HALF_PCT = 16.0  # Step-GRPO against the vanilla model: half the paper's 32% fewer tokens
COLLAPSE_FRACTION = 0.5  # a collapsed run: A < COLLAPSE_FRACTION x A_0 of its seed
LAST_STEPS = 10  # training metrics: the mean over the last LAST_STEPS steps
VANILLA, BASELINE = "vanilla", "baseline"
ARM_ORDER = (  # the report's row order (README's table); an arm not named here follows, in stored order
    "vanilla",
    "baseline",
    "kimi_length",
    "dapo_overlong",
    "step_grpo_reward",
    "step_grpo_advantage",
    "grsp_ascending",
    "grsp_descending",
)
GRSP_ASCENDING, GRSP_DESCENDING = "grsp_ascending", "grsp_descending"
STEP_GRPO_REWARD, STEP_GRPO_ADVANTAGE = "step_grpo_reward", "step_grpo_advantage"
SHORTENING_CLAIM = "claim: shortens without costing accuracy"
COLLAPSE_CLAIM = "claim: ascending weights collapse accuracy"
TRAINING_KEYS = {  # summary name -> metrics.jsonl key, averaged over the last LAST_STEPS steps
    "train_accuracy": "reward/accuracy",
    "train_length": "response/length_mean",
    "train_truncated": "response/truncated_frac",
}
PAPER_FIGURES = {
    "step_grpo_reward": "Step-GRPO (arXiv 2604.16890, Qwen3-8B): -32% tokens vs the vanilla model, accuracy 82.1 vs "
    "79.9 (+2.2 points)",
    "step_grpo_advantage": "(our former combination of Step-GRPO's reward; the paper: -32% tokens, +2.2 points)",
    "kimi_length": "Kimi k1.5 length reward (arXiv 2501.12599): no figure in REFERENCE.md",
    "dapo_overlong": "DAPO overlong punishment (arXiv 2503.14476): targets truncated answers; no length figure",
    "grsp_ascending": "GRSP (arXiv 2510.09535, a reconstruction): ascending weights collapsed accuracy (no figure)",
    "grsp_descending": "GRSP (arXiv 2510.09535, a reconstruction): no figure quoted",
}


def run_identity(run: RunData) -> tuple[str, str, int]:
    """(warm start, arm, seed) of a run named ``<warm start>-<arm>_s<seed>``."""
    warm_start, _, rest = run.path.name.partition("-")
    arm = rest.rsplit("_s", 1)[0]
    if not warm_start or not arm:
        raise ValueError(f"run {run.path} is not named <warm start>-<arm>_s<seed> (tools/e4_shaping_study.sh)")
    return warm_start, arm, int(run.config["trainer"]["seed"])


def _last(run: RunData, key: str) -> float | None:
    values = run.metric_series(key)[1]
    return float(values[-1]) if values else None


def _tail_mean(run: RunData, key: str) -> float | None:
    values = [float(v) for v in run.metric_series(key)[1][-LAST_STEPS:] if math.isfinite(float(v))]
    return math.fsum(values) / len(values) if values else None


def summarize_run(run: RunData) -> dict:
    warm_start, arm, seed = run_identity(run)
    summary: dict = {"run": run.path.name, "warm_start": warm_start, "arm": arm, "seed": seed}
    summary["accuracy"] = _last(run, "eval/pass@1")
    summary["length"] = _last(run, "eval/response_length")
    summary["eval_prompts"] = int(run.config["trainer"]["eval_prompts"])
    for name, key in TRAINING_KEYS.items():
        summary[name] = _tail_mean(run, key)
    return summary


NUMBERS = ("accuracy", "length", *TRAINING_KEYS)


def summarize_arms(runs: list[RunData]) -> dict[str, dict[str, dict]]:
    """{warm start: {arm: {"runs": [summaries by seed], "numbers": {name: Stat}}}}, in stored order."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for run in runs:
        summary = summarize_run(run)
        grouped.setdefault(summary["warm_start"], {}).setdefault(summary["arm"], []).append(summary)
    arms: dict[str, dict[str, dict]] = {}
    for warm_start, by_arm in grouped.items():
        arms[warm_start] = {}
        ordered = [a for a in ARM_ORDER if a in by_arm] + [a for a in by_arm if a not in ARM_ORDER]
        for arm in ordered:
            summaries = by_arm[arm]
            summaries.sort(key=lambda s: s["seed"])
            numbers = {n: Stat.of((s[n] for s in summaries), exact=True).to_dict() for n in NUMBERS}
            arms[warm_start][arm] = {"runs": summaries, "numbers": numbers}
    _mark_collapses(arms)
    return arms


def _mark_collapses(arms: dict) -> None:
    """A run collapsed when its A < COLLAPSE_FRACTION x A_0 of the same seed's vanilla run."""
    for by_arm in arms.values():
        vanilla = {s["seed"]: s["accuracy"] for s in by_arm.get(VANILLA, {"runs": []})["runs"]}
        for entry in by_arm.values():
            for s in entry["runs"]:
                a0 = vanilla.get(s["seed"])
                s["collapsed"] = None if a0 is None or s["accuracy"] is None else s["accuracy"] < COLLAPSE_FRACTION * a0
            entry["collapses"] = sum(1 for s in entry["runs"] if s["collapsed"])


def greater(x: Sequence[float], y: Sequence[float]) -> dict:
    """One-sided exact Mann-Whitney, H1: x tends to exceed y; medians beside it."""
    if not x or not y:
        return {"p": None, "median_x": None, "median_y": None, "n": [len(x), len(y)]}
    return {
        "p": mann_whitney_greater(x, y),
        "median_x": statistics.median(x),
        "median_y": statistics.median(y),
        "n": [len(x), len(y)],
    }


def noise_floor(x: Sequence[float], y: Sequence[float], prompts: int) -> float | None:
    """NF (module docstring) of mean(x) - mean(y), accuracies of two run sets with ``prompts`` prompts each."""
    if not x or not y:
        return None
    sx, sy = Stat.of(x, exact=True), Stat.of(y, exact=True)
    assert sx.std is not None and sy.std is not None
    seeds = math.sqrt(sx.std**2 / sx.n + sy.std**2 / sy.n)
    p = math.fsum([*x, *y]) / (len(x) + len(y))
    sampling = math.sqrt(p * (1.0 - p) / prompts * (1.0 / sx.n + 1.0 / sy.n))
    return 2.0 * max(seeds, sampling)


def _values(entry: dict | None, name: str) -> list[float]:
    return [] if entry is None else list(entry["numbers"][name]["values"])


def _significant(test: dict) -> bool:
    return test["p"] is not None and test["p"] < ALPHA


def compare(arm: dict, reference: dict, prompts: int) -> dict:
    """Test 1 (shorter than the reference) and test 2 (accuracy against the noise floor) of ``arm``."""
    a_x, a_r = _values(arm, "accuracy"), _values(reference, "accuracy")
    l_x, l_r = _values(arm, "length"), _values(reference, "length")
    if not (a_x and a_r and l_x and l_r):
        return {"length_change_pct": None, "accuracy_change_points": None, "noise_floor_points": None}
    mean = Stat.of
    length_change = 100.0 * (mean(l_x, exact=True).mean / mean(l_r, exact=True).mean - 1.0)  # type: ignore[operator]
    accuracy_change = 100.0 * (mean(a_x, exact=True).mean - mean(a_r, exact=True).mean)  # type: ignore[operator]
    floor = noise_floor(a_x, a_r, prompts)
    return {
        "length_change_pct": length_change,
        "shorter": greater(l_r, l_x),  # H1: the reference's lengths exceed the arm's
        "accuracy_change_points": accuracy_change,
        "noise_floor_points": None if floor is None else 100.0 * floor,
        "less_accurate": greater(a_r, a_x),  # H1: the reference's accuracies exceed the arm's
    }


def _reads(result: dict, shorter_by: float) -> dict[str, bool]:
    """The pre-registered readings of one comparison."""
    if result["length_change_pct"] is None:
        return {}
    change, accuracy = result["length_change_pct"], result["accuracy_change_points"]
    floor = result["noise_floor_points"]
    return {
        "shortens": _significant(result["shorter"]) and change <= -shorter_by,
        "keeps_accuracy": accuracy >= -floor,
        "costs_accuracy": accuracy < -floor and _significant(result["less_accurate"]),
        "nil_shortening": change > -NIL_PCT,
    }


def shortening_verdict(reads: dict[str, bool]) -> str:
    """The verdict on "shortens without costing accuracy" (README's rule)."""
    if not reads:
        return "no data"
    if reads["shortens"] and reads["keeps_accuracy"]:
        return "reproduced"
    if reads["costs_accuracy"] or reads["nil_shortening"]:
        return "not reproduced"
    return "undetermined at this power"


def collapse_verdict(reads: dict[str, bool]) -> str:
    """GRSP ascending "collapses accuracy" (README's rule)."""
    if not reads:
        return "no data"
    if reads["costs_accuracy"]:
        return "reproduced"
    if reads["keeps_accuracy"]:
        return "not reproduced"
    return "undetermined at this power"


def judge_warm_start(by_arm: dict, prompts: int) -> dict:
    """Every pre-registered comparison and verdict of one warm start's arms."""
    baseline, vanilla = by_arm.get(BASELINE), by_arm.get(VANILLA)
    judged: dict = {"baseline_vs_vanilla": compare(baseline, vanilla, prompts) if baseline and vanilla else {}}
    for arm, entry in by_arm.items():
        if arm in (VANILLA, BASELINE):
            continue
        vs_baseline = compare(entry, baseline, prompts) if baseline else {"length_change_pct": None}
        vs_vanilla = compare(entry, vanilla, prompts) if vanilla else {"length_change_pct": None}
        result: dict = {"vs_baseline": vs_baseline, "vs_vanilla": vs_vanilla, "figure": PAPER_FIGURES.get(arm, "")}
        reads = _reads(vs_baseline, SHORTER_BY_PCT)
        result["reads_vs_baseline"] = reads
        result["verdict"] = collapse_verdict(reads) if arm == GRSP_ASCENDING else shortening_verdict(reads)
        if arm == GRSP_ASCENDING and baseline:
            n_x, n_b = len(entry["runs"]), len(baseline["runs"])
            result["more_collapses"] = {
                "p": fisher_greater(entry["collapses"], n_x, baseline["collapses"], n_b),
                "collapses": [entry["collapses"], baseline["collapses"]],
                "n": [n_x, n_b],
            }
            if GRSP_DESCENDING in by_arm:
                vs_descending = compare(entry, by_arm[GRSP_DESCENDING], prompts)
                result["vs_descending"] = vs_descending
                result["verdict_vs_descending"] = collapse_verdict(_reads(vs_descending, SHORTER_BY_PCT))
        if arm.startswith("step_grpo"):
            paper_reads = _reads(vs_vanilla, PAPER_HALF_PCT)
            result["reads_vs_vanilla"] = paper_reads
            result["verdict_vs_paper_figure"] = shortening_verdict(paper_reads)
        judged[arm] = result
    if STEP_GRPO_REWARD in by_arm and STEP_GRPO_ADVANTAGE in by_arm:
        reward, advantage = by_arm[STEP_GRPO_REWARD], by_arm[STEP_GRPO_ADVANTAGE]
        judged["combine_reward_vs_advantage"] = {  # both one-sided p's, no verdict (README)
            "reward_shorter": greater(_values(advantage, "length"), _values(reward, "length")),
            "advantage_shorter": greater(_values(reward, "length"), _values(advantage, "length")),
            "reward_more_accurate": greater(_values(reward, "accuracy"), _values(advantage, "accuracy")),
            "advantage_more_accurate": greater(_values(advantage, "accuracy"), _values(reward, "accuracy")),
        }
    return judged


def _prompts(arms: dict) -> int:
    counts = {s["eval_prompts"] for by_arm in arms.values() for e in by_arm.values() for s in e["runs"]}
    if len(counts) != 1:
        raise ValueError(f"E4's runs must share trainer.eval_prompts, got {sorted(counts)}")
    return counts.pop()


def _p(test: dict | None) -> str:
    return "--" if not test or test.get("p") is None else f"{test['p']:.3g}"


def _signed(value: float | None, digits: int = 1) -> str:
    return "--" if value is None else f"{value:+.{digits}f}"


def _comparison_cells(result: dict) -> list[str]:
    """L change (%), A change (points) and the noise floor (points) of one comparison."""
    if result.get("length_change_pct") is None:
        return ["--"] * 3
    return [
        f"{_signed(result['length_change_pct'])}% (p {_p(result['shorter'])})",
        f"{_signed(result['accuracy_change_points'])} (p {_p(result['less_accurate'])})",
        f"{result['noise_floor_points']:.1f}",
    ]


def provenance_summary(arms: dict, provenance: dict) -> list[str]:
    """One line per warm start: its runs' commits, clean-tree flags, threads and warm-start sha256."""
    lines = []
    for warm_start, by_arm in arms.items():
        names = [s["run"] for entry in by_arm.values() for s in entry["runs"]]
        known = [provenance[n] for n in names if n in provenance]
        values = {key: sorted({str(p[key]) for p in known}) for key in ("commit", "clean_tree", "cpu_threads")}
        shas = sorted({str(p["warm_start_sha256"])[:16] for p in known})
        lines.append(
            f"- {warm_start}: {len(names)} runs; commit {', '.join(c[:12] for c in values['commit'])}; clean tree "
            f"{', '.join(values['clean_tree'])}; threads {', '.join(values['cpu_threads'])}; warm start sha256 "
            f"{', '.join(shas)}"
        )
    return lines


def render_markdown(arms: dict, judged: dict, prompts: int, provenance: dict) -> str:
    lines = [
        "# E4: length shaping against the papers' comparisons",
        "",
        f"A = pass@1 and L = mean tokens of {prompts} sampled evaluation responses (temperature 1) at the last step;",
        "mean ± sample std over seeds; p: one-sided exact Mann-Whitney (shorter; less accurate); NF: the accuracy",
        "noise floor in points (README.md). Rules fixed in README.md before the runs.",
        "",
        *provenance_summary(arms, provenance),
    ]
    for warm_start, by_arm in arms.items():
        lines += ["", f"## Warm start {warm_start}", ""]
        header = [
            "arm",
            "seeds",
            "A",
            "L",
            "L vs baseline",
            "A vs baseline (points)",
            "NF",
            "L vs vanilla",
            "A vs vanilla (points)",
            "NF (vanilla)",
            "collapsed runs",
            "train acc (last 10)",
            "train len (last 10)",
            "truncated (last 10)",
            "verdict",
        ]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        results = judged[warm_start]
        for arm, entry in by_arm.items():
            numbers = entry["numbers"]
            if arm == VANILLA:
                comparisons = ["--"] * 6
            elif arm == BASELINE:
                comparisons = ["0", "0", "--", *_comparison_cells(results["baseline_vs_vanilla"])]
            else:
                comparisons = [
                    *_comparison_cells(results[arm]["vs_baseline"]),
                    *_comparison_cells(results[arm]["vs_vanilla"]),
                ]
            verdict = "--" if arm in (VANILLA, BASELINE) else results[arm]["verdict"]
            cells = [
                arm,
                str(len(entry["runs"])),
                stat_cell(numbers["accuracy"]),
                stat_cell(numbers["length"]),
                *comparisons,
                "--" if arm == VANILLA else f"{entry['collapses']}/{len(entry['runs'])}",
                stat_cell(numbers["train_accuracy"]),
                stat_cell(numbers["train_length"]),
                stat_cell(numbers["train_truncated"], 2),
                verdict,
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Verdicts and the papers' figures:", ""]
        for arm, result in results.items():
            if arm in ("baseline_vs_vanilla", "combine_reward_vs_advantage"):
                continue
            claim = COLLAPSE_CLAIM if arm == GRSP_ASCENDING else SHORTENING_CLAIM
            line = f"- {arm} ({claim}): **{result['verdict']}**"
            if "verdict_vs_paper_figure" in result:
                line += f"; against the paper's figure (vs vanilla, >= {PAPER_HALF_PCT:g}% shorter): "
                line += f"**{result['verdict_vs_paper_figure']}**"
            if "more_collapses" in result:
                test = result["more_collapses"]
                line += (
                    f"; collapsed runs {test['collapses'][0]}/{test['n'][0]} vs baseline "
                    f"{test['collapses'][1]}/{test['n'][1]} (Fisher p {_p(test)})"
                )
            if "verdict_vs_descending" in result:
                line += f"; against descending: **{result['verdict_vs_descending']}**"
            lines.append(f"{line}. Source: {result['figure']}")
        if "combine_reward_vs_advantage" in results:
            c = results["combine_reward_vs_advantage"]
            lines.append(
                "- Step-GRPO, combine=reward vs combine=advantage (no verdict): reward shorter p "
                f"{_p(c['reward_shorter'])}, advantage shorter p {_p(c['advantage_shorter'])}; reward more "
                f"accurate p {_p(c['reward_more_accurate'])}, advantage more accurate p "
                f"{_p(c['advantage_more_accurate'])}"
            )
    return "\n".join(lines) + "\n"


def study_files(runs: list[RunData], manifests: dict) -> tuple[dict, str]:
    """(report.json's document, report.md's text) of the stored runs."""
    arms = summarize_arms(runs)
    prompts = _prompts(arms)
    judged = {warm_start: judge_warm_start(by_arm, prompts) for warm_start, by_arm in arms.items()}
    provenance = reported_provenance(manifests)
    document = {"eval_prompts": prompts, "judged": judged, "arms": arms, "runs": provenance}
    return document, render_markdown(arms, judged, prompts, provenance)
