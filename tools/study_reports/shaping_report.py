"""Summaries of shaping runs: per run, then per arm over seeds (mean, sample std, n), beside the papers.

Design decisions:
- Input is each run's ``metrics.jsonl`` (one JSON object per RL step; eval entries carry ``eval/*``
  keys). A run is summarised by the mean over its last ``last_steps`` training steps (rollout-time
  tokens, keyword steps, segments per length cluster, accuracy, DTR exit fractions) and by its last
  evaluation (held-out prompts, plain decoding: DTR is a training-rollout procedure).
- Seeds aggregate as mean and sample standard deviation (n - 1); a metric a run lacks is left out of
  that arm's n rather than counted as 0.
- Relative numbers (token change, accuracy change) compare each arm's seed means with the arm named
  ``baseline`` and with the warm start evaluated before any RL step (the "vanilla model" the
  Step-GRPO paper measures against); they are printed beside the sources' claims -- only figures the
  method descriptions contain, from much larger models -- to say what is and is not reproduced.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

# name in the summary -> key in metrics.jsonl
TRAIN_KEYS = {
    "tokens": "response/length_mean",
    "steps": "shaping/steps_per_response",
    "accuracy": "reward/accuracy",
    "exit_confident": "truncation/exit_confident_frac",
    "exit_think_budget": "truncation/exit_think_budget_frac",
    "probes": "truncation/probes_mean",
}
EVAL_KEYS = {"eval_accuracy": "eval/pass@1", "eval_tokens": "eval/response_length"}
CLUSTER_PREFIX = "shaping/segments_per_cluster/"
# Only figures the method descriptions contain, with the baseline they are measured against.
STEP_GRPO_CLAIM = (
    "Step-GRPO (Qwen3-8B, arXiv 2604.16890 abstract): -32.0% tokens vs the vanilla model, without "
    "the accuracy degradation of length penalties -- compare eval_tokens vs vanilla"
)
PAPER_CLAIMS = {
    "step_grpo_dtr": STEP_GRPO_CLAIM,
    "step_grpo_dtr_exit_trained": STEP_GRPO_CLAIM,  # the same method; only what the loss sees differs
    "grsp_keyword": "GRSP (arXiv 2510.09535): no figure quoted here (constants not available; reconstruction)",
    "grsp_confidence": "GRSP (arXiv 2510.09535): no figure quoted here (constants not available; reconstruction)",
}


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a finished training run?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(metrics: list[dict], last_steps: int = 10) -> dict[str, float]:
    """Mean of the training metrics over the last ``last_steps`` steps, and the last evaluation."""
    train = [m for m in metrics if "response/length_mean" in m][-last_steps:]
    if not train:
        raise ValueError("the run logged no training step (no response/length_mean)")
    keys = dict(TRAIN_KEYS)
    keys.update(
        {
            f"segments_c{k[len(CLUSTER_PREFIX) :]}": k
            for k in sorted({k for m in train for k in m if k.startswith(CLUSTER_PREFIX)})
        }
    )
    summary = {}
    for name, key in keys.items():
        values = [m[key] for m in train if key in m]
        if values:
            summary[name] = math.fsum(values) / len(values)
    evals = [m for m in metrics if EVAL_KEYS["eval_accuracy"] in m]
    for name, key in EVAL_KEYS.items():
        if evals and key in evals[-1]:
            summary[name] = evals[-1][key]
    return summary


def aggregate(summaries: Iterable[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per metric: mean, std (sample, 0 for one seed) and n over the runs that logged it."""
    summaries = list(summaries)
    out = {}
    for name in sorted({k for s in summaries for k in s}):
        values = [s[name] for s in summaries if name in s]
        mean = math.fsum(values) / len(values)
        var = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
        out[name] = {"mean": mean, "std": math.sqrt(var), "n": len(values)}
    return out


def relative_to_baseline(arms: dict[str, dict], baseline: str = "baseline") -> dict[str, dict[str, float]]:
    """Token change (%) and accuracy change (points) of each arm's seed means vs the baseline arm."""
    base = arms.get(baseline)
    if base is None:
        return {}
    out = {}
    for arm, stats in arms.items():
        row = {}
        for tokens in ("tokens", "eval_tokens"):
            if tokens in stats and tokens in base and base[tokens]["mean"]:
                row[f"{tokens}_change_pct"] = 100 * (stats[tokens]["mean"] / base[tokens]["mean"] - 1)
        for acc in ("accuracy", "eval_accuracy"):
            if acc in stats and acc in base:
                row[f"{acc}_change_points"] = 100 * (stats[acc]["mean"] - base[acc]["mean"])
        out[arm] = row
    return out


def relative_to_vanilla(arms: dict[str, dict], vanilla: dict[str, float]) -> dict[str, dict[str, float]]:
    """Evaluation-token change (%) and pass@1 change (points) of each arm's seed means vs the warm start
    evaluated before any RL step (``vanilla``: the trainer's ``eval/*`` keys) -- the Step-GRPO paper's
    baseline. Evaluation decodes without truncation, so this is learned brevity, not DTR's cut."""
    base_tokens, base_accuracy = vanilla.get(EVAL_KEYS["eval_tokens"]), vanilla.get(EVAL_KEYS["eval_accuracy"])
    out = {}
    for arm, stats in arms.items():
        row = {}
        if "eval_tokens" in stats and base_tokens:
            row["eval_tokens_change_pct"] = 100 * (stats["eval_tokens"]["mean"] / base_tokens - 1)
        if "eval_accuracy" in stats and base_accuracy is not None:
            row["eval_accuracy_change_points"] = 100 * (stats["eval_accuracy"]["mean"] - base_accuracy)
        out[arm] = row
    return out


def _cell(stat: dict | None, digits: int = 3) -> str:
    if stat is None:
        return "-"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f} (n={stat['n']})"


def render_markdown(
    arms: dict[str, dict], relative: dict[str, dict], notes: list[str], vs_vanilla: dict[str, dict] | None = None
) -> str:
    """The report table: one row per arm, seed mean ± sample std, the change vs the baseline arm and vs
    the untrained warm start (the vanilla model), beside what the source claims."""
    names = {k for stats in arms.values() for k in stats}
    columns = sorted(names, key=lambda k: (k.startswith("segments"), k))
    lines = ["| arm | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for arm, stats in arms.items():
        lines.append(f"| {arm} | " + " | ".join(_cell(stats.get(c)) for c in columns) + " |")
    lines += [
        "",
        "| arm | change vs baseline arm | change vs vanilla (warm start) | source's claim |",
        "|---|---|---|---|",
    ]
    for arm, row in relative.items():
        change = ", ".join(f"{k} {v:+.1f}" for k, v in row.items()) or "-"
        vanilla = ", ".join(f"{k} {v:+.1f}" for k, v in (vs_vanilla or {}).get(arm, {}).items()) or "-"
        lines.append(f"| {arm} | {change} | {vanilla} | {PAPER_CLAIMS.get(arm, '-')} |")
    return "\n".join(lines + [""] + [f"- {note}" for note in notes]) + "\n"


def study_files(runs_by_arm: dict[str, list[list[dict]]], inputs: dict) -> tuple[dict, str]:
    """``report.json``'s document and ``report.md`` from each arm's runs' metrics (seeds in order) and the
    study's inputs besides its runs (``inputs``: last_steps, vanilla, warm_start, confidence_calibration,
    notes; stored in the study's store.json, ``study_reports/store.py``)."""
    runs = {
        arm: [summarize_run(metrics, inputs["last_steps"]) for metrics in seeds] for arm, seeds in runs_by_arm.items()
    }
    stats = {arm: aggregate(summaries) for arm, summaries in runs.items()}
    relative = relative_to_baseline(stats)
    against_vanilla = relative_to_vanilla(stats, inputs["vanilla"])
    document = {
        "arms": stats,
        "relative": relative,
        "vs_vanilla": against_vanilla,
        "vanilla": inputs["vanilla"],
        "warm_start": inputs["warm_start"],
        "confidence_calibration": inputs["confidence_calibration"],
        "notes": inputs["notes"],
        "runs": runs,
    }
    return document, render_markdown(stats, relative, inputs["notes"], against_vanilla)
