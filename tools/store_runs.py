"""Store a sweep's runs in a study's directory (``study_reports/store.py``), so its report can be rebuilt
from the repository alone (``tools/regenerate_report.py``).

    python3 tools/store_runs.py multirun/<sweep> --study reports/routing_stability_miniature

Arguments are run directories or sweep directories (expanded into their runs, in name order; files such as
``multirun.yaml`` are skipped with a note). Writes ``STUDY/store.json`` and ``STUDY/stored_runs/<run>/``
(manifest, config, gzip'd metrics and routing records), replacing an earlier store of that study, and prints the size.
``main(argv)`` returns the exit status (0 ok, 2 bad input).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, whatever is installed

from gspo_megatron.core.run_dir import RunDirError
from study_reports.aggregate import DEFAULT_SEED_KEYS, expand_run_paths
from study_reports.store import RUNS_DIR, StoreError, save_runs

ROUTING_REPORT = "routing_study"  # tools/regenerate_report.py's REPORTS: compare_runs' study report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="store_runs", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories or sweep directories")
    parser.add_argument("--study", required=True, help="the study's directory, e.g. reports/<study>")
    parser.add_argument("--report", default=ROUTING_REPORT, help=f"the report kind (default {ROUTING_REPORT})")
    parser.add_argument("--seed-key", action="append", default=None, help=f"default {DEFAULT_SEED_KEYS}")
    args = parser.parse_args(argv)
    run_paths, skipped = expand_run_paths(args.runs)
    for path in skipped:
        print(f"store_runs: skipping {path} (not a run directory)", file=sys.stderr)
    if not run_paths:
        print(f"store_runs: error: no run directories among {args.runs}", file=sys.stderr)
        return 2
    try:
        index = save_runs(run_paths, Path(args.study), args.report, args.seed_key or DEFAULT_SEED_KEYS)
    except (RunDirError, StoreError) as err:
        print(f"store_runs: error: {err}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in (Path(args.study) / RUNS_DIR).rglob("*") if p.is_file())
    print(f"stored {len(run_paths)} runs in {index.parent / RUNS_DIR} ({size / 1024:.0f} KiB) and {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
