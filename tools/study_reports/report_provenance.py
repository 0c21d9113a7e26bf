"""What a study report records so it can be traced and regenerated: the report's own commit and
command, and per run its commit, command, seeds and composed config.

Design decisions:
- Configs are stored once: the keys every run shares (``config_common``) and, per run, only the keys
  where it differs (``config_diff``); together they are each run's whole composed ``config.yaml``.
- Runs from different commits (or with uncommitted changes, or from before runs recorded their
  commit) are not refused -- a sweep may be resumed on newer code on purpose -- but warned about,
  in the report and on stderr: such numbers may not come from one piece of code. So are runs that
  used different CPU thread counts or started from different warm starts (different weights' sha256):
  the same code then gives different numbers (``gspo_megatron/core/provenance.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from gspo_megatron.core.config_node import flatten_dotted
from gspo_megatron.core.provenance import provenance
from gspo_megatron.core.run_dir import RunData

SEED_CONFIG_KEYS = ("trainer.seed", "model.init_seed")
NOT_RECORDED = "not recorded"


def runs_provenance(runs: Sequence[RunData]) -> dict:
    """The report's provenance (JSON-able): its own commit/command, the runs' commits, seeds, configs."""
    flat = {str(run.path): flatten_dotted(run.config) for run in runs}
    shared = set.intersection(*(_hashable(f.items()) for f in flat.values())) if flat else set()
    common_keys = {key for key, _ in shared}
    commits: dict[str, list[str]] = {}
    for run in runs:
        commits.setdefault(run.commit or NOT_RECORDED, []).append(str(run.path))
    inputs = {str(run.path): run_inputs(run.provenance) for run in runs}
    return {
        "generated_by": provenance(),
        "commits": commits,
        "warnings": commit_warnings(commits) + input_warnings(inputs),
        "runs": {
            str(run.path): {
                "commit": run.commit or NOT_RECORDED,
                "command": run.provenance.get("command", NOT_RECORDED),
                **inputs[str(run.path)],
                "seeds": {key: flat[str(run.path)].get(key) for key in SEED_CONFIG_KEYS},
                "config_diff": {k: v for k, v in flat[str(run.path)].items() if k not in common_keys},
            }
            for run in runs
        },
        "config_common": {k: v for k, v in sorted(flat[str(runs[0].path)].items()) if k in common_keys} if runs else {},
    }


def run_inputs(record: dict) -> dict:
    """What besides the code a run's numbers depend on: its CPU thread count and its warm start."""
    warm = record.get("warm_start")
    return {
        "cpu_threads": record.get("cpu_threads", NOT_RECORDED),
        "warm_start": NOT_RECORDED if not warm else f"{warm.get('weights_sha256', '?')[:16]} ({warm.get('command')})",
    }


def input_warnings(inputs: dict[str, dict]) -> list[str]:
    """One line per input that differs between the runs that recorded it."""
    warnings = []
    for key, what in (("cpu_threads", "CPU thread counts"), ("warm_start", "warm starts")):
        seen: dict[str, int] = {}
        for run in inputs.values():
            if run[key] != NOT_RECORDED:
                seen[str(run[key])] = seen.get(str(run[key]), 0) + 1
        if len(seen) > 1:
            counts = ", ".join(f"{value} ({n} runs)" for value, n in sorted(seen.items()))
            warnings.append(f"the runs used different {what}: {counts}")
    return warnings


def _short(commit: str) -> str:
    if commit == NOT_RECORDED:
        return commit
    return commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")


def _hashable(items):
    return {(k, repr(v)) for k, v in items}


def commit_warnings(commits: dict[str, list[str]]) -> list[str]:
    """One line per problem: several commits, uncommitted changes, runs that recorded none."""
    warnings = []
    if len(commits) > 1:
        counts = ", ".join(f"{_short(commit)} ({len(paths)} runs)" for commit, paths in sorted(commits.items()))
        warnings.append(f"the runs come from different commits: {counts}")
    dirty = [c for c in commits if c.endswith("+dirty")]
    if dirty:
        warnings.append(f"runs from a checkout with uncommitted changes: {', '.join(_short(c) for c in dirty)}")
    if NOT_RECORDED in commits:
        warnings.append(f"{len(commits[NOT_RECORDED])} runs recorded no commit (no provenance.json)")
    return warnings
