"""An agent study's summary from its stored runs (reports/agent_calculator/, reports/agent_lookup/: README.md).

    python3 tools/agent_report.py reports/agent_calculator    # or reports/agent_lookup

Reads every ``metrics_s<seed>.jsonl`` in the directory and writes ``summary.json`` beside them: per seed, the
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

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


def summarize(directory: Path) -> dict:
    from gspo_megatron.core.provenance import provenance

    runs = {}
    for path in sorted(directory.glob("metrics_s*.jsonl")):
        seed = re.fullmatch(r"metrics_s(\d+)\.jsonl", path.name)
        if seed is None:
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs[seed.group(1)] = seed_summary(rows)
    if not runs:
        raise SystemExit(f"no metrics_s<seed>.jsonl in {directory}")
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
        "provenance": provenance(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    summary = summarize(args.directory)
    (args.directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
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
