"""An agent study's summary from its stored runs (reports/agent_calculator/, reports/agent_lookup/: README.md).

    python3 tools/store_runs.py runs/agent_calculator_s1 runs/agent_calculator_s2 runs/agent_calculator_s3 \
        --study reports/agent_calculator --report agent_study
    python3 tools/agent_report.py reports/agent_calculator    # or reports/agent_lookup

Reads the runs of the directory's study store (``study_reports/store.py``; run ``<name>_s<seed>``) and writes
``summary.json`` beside them: per seed, the
mean reward and the tool use of the first and the last 20% of steps, the largest engine-vs-trainer
routing difference and log-prob gap of any step, the greedy evaluations, and whether the README's criterion
holds; the warm start's own greedy evaluation (``warm_start_eval.jsonl``, when stored); the commit and command
that wrote the summary (``core/provenance.py``). Prints the same as a table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

if TYPE_CHECKING:
    from study_reports.store import StoredStudy

RISE, TOOL_USE = 0.3, 0.8  # the criterion (each study's README.md: the same for both)


def seed_summary(rows: list[dict]) -> dict:
    """One run's numbers; ``rows``: its metrics.jsonl records in step order."""
    window = max(1, len(rows) // 5)
    first = statistics.mean(r["reward/mean"] for r in rows[:window])
    last = statistics.mean(r["reward/mean"] for r in rows[-window:])
    tools_first = statistics.mean(r["agent/tool_used_frac"] for r in rows[:window])
    tools = statistics.mean(r["agent/tool_used_frac"] for r in rows[-window:])
    return {
        "steps": len(rows),
        "reward_first_20pct": first,
        "reward_last_20pct": last,
        "tool_use_first_20pct": tools_first,
        "tool_use_last_20pct": tools,
        "routing_rollout_vs_train_changed_frac_max": max(
            r.get("routing/rollout_vs_train_changed_frac", 0.0) for r in rows
        ),
        "mismatch_abs_log_prob_diff_max": max(r.get("mismatch/abs_log_prob_diff_mean", 0.0) for r in rows),
        # the greedy policy (rollout.eval_temperature=0) at the run's evaluations: not part of the criterion
        "eval_pass_at_1": {str(r["step"]): r["eval/pass@1"] for r in rows if "eval/pass@1" in r},
        "criterion_holds": last >= first + RISE and tools >= TOOL_USE,
    }


def run_seed(name: str) -> str:
    """The seed in a stored run's name ``<name>_s<seed>`` (the study's run directories)."""
    seed = re.fullmatch(r".*_s(\d+)", name)
    if seed is None:
        raise SystemExit(f"stored run {name!r}: expected a name <name>_s<seed>, as runs/agent_calculator_s1")
    return seed.group(1)


def summarize(directory: Path) -> dict:
    """The summary of the directory's stored runs."""
    from study_reports.store import load_store

    return summary_from_store(load_store(directory))


def summary_from_store(study: StoredStudy) -> dict:
    """``summary.json``'s document, with the commit and command that wrote it (``provenance``)."""
    from gspo_megatron.core.provenance import provenance

    metrics = {run_seed(run.path.name): run.metrics for run in study.runs}
    return {**summary_of(metrics, study.directory), "provenance": provenance()}


def summary_of(metrics_by_seed: dict[str, list[dict]], directory: Path) -> dict:
    """Per seed and over seeds, from each run's metrics records in step order; the warm start's evaluation from
    the directory's ``warm_start_eval.jsonl`` when stored."""
    runs = {seed: seed_summary(rows) for seed, rows in metrics_by_seed.items()}
    if not runs:
        raise SystemExit(f"no stored runs in {directory}")
    rises = [run["reward_last_20pct"] - run["reward_first_20pct"] for run in runs.values()]
    warm = directory / "warm_start_eval.jsonl"  # the warm start's own evaluation (README), when stored
    warm_rows = [json.loads(line) for line in warm.read_text().splitlines() if line.strip()] if warm.is_file() else []
    return {
        "seeds": runs,
        "rise_mean": statistics.mean(rises),
        "rise_min": min(rises),
        "rise_max": max(rises),
        "criterion_holds_for_every_seed": all(run["criterion_holds"] for run in runs.values()),
        "warm_start_eval_pass_at_1": warm_rows[0]["eval/pass@1"] if warm_rows else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    summary = summarize(args.directory)
    (args.directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)


def print_summary(summary: dict) -> None:
    print("seed  reward first 20%  last 20%  tool use first  last  routing diff  criterion")
    for seed, run in summary["seeds"].items():
        print(
            f"{seed:>4}  {run['reward_first_20pct']:16.3f}  {run['reward_last_20pct']:8.3f}  "
            f"{run['tool_use_first_20pct']:14.3f}  {run['tool_use_last_20pct']:4.2f}  "
            f"{run['routing_rollout_vs_train_changed_frac_max']:12.4f}  "
            f"{'holds' if run['criterion_holds'] else 'FAILS'}"
        )
    print(f"rise {summary['rise_mean']:.3f} (min {summary['rise_min']:.3f}, max {summary['rise_max']:.3f})")
    evals = {seed: run["eval_pass_at_1"] for seed, run in summary["seeds"].items()}
    print(f"greedy pass@1: warm start {summary['warm_start_eval_pass_at_1']}; by seed and step {evals}")


if __name__ == "__main__":
    main()
