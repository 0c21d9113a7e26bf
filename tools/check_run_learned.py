"""Exit 1 unless a run's mean reward rose by at least ``--min-rise``: the last fifth of its steps against
the first, the windows its summary prints (CI's newest-stack leg checks the main job with it).

    python3 tools/check_run_learned.py runs/<date>_gspo --min-rise 0.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

from gspo_megatron.core.run_dir import RunDirError, read_jsonl
from gspo_megatron.run.run_log import fifth_mean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--min-rise", type=float, required=True, help="absolute rise of reward/mean required")
    args = parser.parse_args(argv)
    try:
        history = read_jsonl(args.run_dir / "metrics.jsonl")
    except (OSError, RunDirError) as error:
        print(f"[check] {args.run_dir}: no metrics to check ({error})", file=sys.stderr)
        return 1
    first, last = fifth_mean(history, "reward/mean", True), fifth_mean(history, "reward/mean", False)
    rise = last - first
    learned = rise >= args.min_rise
    print(
        f"[check] {args.run_dir}: {len(history)} steps, reward/mean first 20% {first:.3f}, last 20% {last:.3f}: "
        f"rise {rise:+.3f} {'>=' if learned else '<'} {args.min_rise}"
    )
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
