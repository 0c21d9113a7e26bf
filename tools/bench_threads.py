"""The main job's wall time under the default thread rule and under every OMP_NUM_THREADS from 1 to the cores.

    python tools/bench_threads.py                          # the main job, 4 steps, 3 interleaved repetitions
    python tools/bench_threads.py --steps 8 --reps 5       # longer runs, more repetitions
    python tools/bench_threads.py --settings 1,2 algorithm=grpo  # chosen OMP_NUM_THREADS values; any overrides

Each run is the command line's job, ``python3 -m gspo_megatron.train trainer.steps=N`` (no evaluation,
progress bar or TensorBoard), in a fresh process and run directory: ``default`` without
``OMP_NUM_THREADS`` in its environment (the rule of ``gspo_megatron/core/threads.py`` decides; the
width it chose is read from its ``threads:`` start-up line), ``OMP_NUM_THREADS=k`` with it set. Every
repetition runs every setting once, in an order rotated by one each repetition, so a drift of the
machine's load hits all settings alike. Reported per setting: the median wall time of the whole
process (start-up, the steps, the wind-down: what a user waits for) with its min-max, the median
time between consecutive steps' records (``time/run_wall_s``: the steps after the first), and the
ratio to the best setting's median wall time. Run it on a quiet machine: it measures nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT = "default"
ROOT = Path(__file__).resolve().parents[1]
# the job as a user runs it, without what prints or writes beside the steps
QUIET = ["trainer.eval_every=0", "logging.progress=false", "logging.tensorboard=false"]
THREADS_LINE = re.compile(r"^threads: (\d+) intra-op \((.*)\)$", re.MULTILINE)


@dataclass(frozen=True)
class Run:
    setting: str
    wall_s: float
    step_s: float | None  # median wall time between consecutive steps' records; None with one step
    threads: int  # the intra-op width the run said it used
    why: str  # and why (the rule, the config key or OMP_NUM_THREADS)


def environment(setting: str) -> dict[str, str]:
    """The run's environment: this one, with OMP_NUM_THREADS removed (default) or set to the setting."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.pop("WORLD_SIZE", None)  # one process: the command line's job
    if setting != DEFAULT:
        env["OMP_NUM_THREADS"] = setting
    return env


def run_job(setting: str, steps: int, overrides: list[str], timeout_s: float) -> Run:
    from gspo_megatron.run.run_log import RUN_WALL_KEY

    with tempfile.TemporaryDirectory(prefix="bench_threads_") as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "gspo_megatron.train", f"trainer.steps={steps}", *QUIET, *overrides]
        started = time.perf_counter()
        done = subprocess.run(
            [*command, f"run_dir={run_dir}"],
            env=environment(setting),
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"the run with {setting} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        said = THREADS_LINE.findall(done.stdout)
        if len(said) != 1:
            raise SystemExit(f"the run with {setting} printed {len(said)} 'threads:' lines, expected one")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    walls = [record[RUN_WALL_KEY] for record in records]  # the run's clock at each step's record
    step_times = [later - earlier for earlier, later in zip(walls, walls[1:], strict=False)]
    step_s = statistics.median(step_times) if step_times else None
    return Run(setting, wall, step_s, threads=int(said[0][0]), why=said[0][1])


def rotated(settings: list[str], repetition: int) -> list[str]:
    """Repetition r runs the settings starting from the r-th: each setting takes each place in turn."""
    shift = repetition % len(settings)
    return settings[shift:] + settings[:shift]


def table(runs: list[Run], settings: list[str]) -> str:
    walls = {s: statistics.median(r.wall_s for r in runs if r.setting == s) for s in settings}
    best = min(walls.values())
    lines = [f"{'setting':<20}{'threads':>8}{'wall s':>9}{'min-max':>15}{'step s':>9}{'x best':>8}"]
    for setting in settings:
        mine = [r for r in runs if r.setting == setting]
        low, high = min(r.wall_s for r in mine), max(r.wall_s for r in mine)
        label = setting if setting == DEFAULT else f"OMP_NUM_THREADS={setting}"
        widths = "/".join(str(w) for w in sorted({r.threads for r in mine}))
        steps = [r.step_s for r in mine if r.step_s is not None]
        step = f"{statistics.median(steps):.3f}" if steps else "-"  # "-": one step per run, no interval
        spread = f"{low:.1f}-{high:.1f}"
        lines.append(f"{label:<20}{widths:>8}{walls[setting]:>9.1f}{spread:>15}{step:>9}{walls[setting] / best:>7.2f}x")
    lines.append(f"default / best = {walls[DEFAULT] / best:.2f} (median wall time of the whole job)")
    return "\n".join(lines)


def thread_counts(text: str) -> list[int]:
    """``--settings``: comma-separated positive integers, e.g. ``1,2``."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated thread counts >= 1, e.g. 1,2")
    return counts


def main(argv=None) -> None:
    from gspo_megatron.core.threads import usable_cores

    cores = usable_cores()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="trainer.steps of each run")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every setting, interleaved")
    parser.add_argument(
        "--settings",
        type=thread_counts,
        default=list(range(1, cores + 1)),
        help=f"OMP_NUM_THREADS values beside the default, comma-separated (default: 1..{cores}, the usable cores)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the job, e.g. algorithm=grpo")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.reps < 1:
        parser.error("--steps and --reps must be >= 1")
    settings = [DEFAULT, *(str(k) for k in args.settings)]
    runs: list[Run] = []
    for repetition in range(args.reps):
        for setting in rotated(settings, repetition):
            runs.append(run_job(setting, args.steps, args.overrides, args.timeout))
            print(f"rep {repetition + 1}/{args.reps} {setting}: {runs[-1].wall_s:.1f} s", flush=True)
    print(
        f"the main job, trainer.steps={args.steps}, {args.reps} repetition(s); {cores} core(s) usable; "
        f"overrides: {' '.join([*QUIET, *args.overrides])}"
    )
    print(f"default: {next(r.why for r in runs if r.setting == DEFAULT)}")
    print(table(runs, settings))


if __name__ == "__main__":
    main()
