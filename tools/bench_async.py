"""Rollout schedules compared in one run: synchronous, one-step async, streaming with k = 2 and k = 4.

    python tools/sft_warmstart.py --out /tmp/long_tail --max-waits 1 --long-tail 0.1 45   # the long-tailed task
    python tools/bench_async.py --warm-start /tmp/long_tail --steps 12 --reps 2
    python tools/bench_async.py --mode drop rollout.max_new_tokens=64   # any Hydra overrides of every arm

Arms (each the real trainer, ``gspo_megatron.train.run``, from ``conf/`` plus the overrides):

    sync        rollout.async_rollout=false
    one_step    rollout.async_rollout=true rollout.max_staleness=1        (rollout/scheduler.py)
    stream_k2   rollout.async_rollout=true rollout.max_staleness=2 rollout.staleness_mode=<--mode>  (streaming.py)
    stream_k4   the same with rollout.max_staleness=4

With ``--warm-start DIR`` every arm starts from that HF checkpoint on ``task=reasoning_max_digit`` (the
long-tailed task ``tools/sft_warmstart.py --long-tail`` writes: most responses short, a few ~10x longer);
without it, from the model's random init on the default task (no long tail: the smoke run's shape).

Design decisions:
- All runs of all arms are in one spawned rank (``run_distributed``), one after the other, so start-up
  (imports, megatron's CPU bridges) is paid once; repetition r runs the arms in an order rotated by r
  (``rotated``), so a drift of the machine's load hits every arm alike.
- Per arm, over the steps after the first ``--warmup`` of each run (pooled over repetitions):
  trained tokens / s = sum(response/length_mean x batch/fed_rows) / sum(step cycle), where a step's cycle
  is the difference of consecutive ``time/run_wall_s`` (everything the run did between two steps' records);
  its ratio to ``sync``'s. The idle fractions are cycle-weighted means. The streaming arms log them
  (``time/trainer_idle_frac``, ``time/engine_idle_frac``, each the step's own: its waits over its cycle); for
  sync and one-step they are derived from the scheduler's ``time/generation`` (the engine side's round:
  generate + score) and ``time/generation_overlap_frac``: trainer idle = generation x (1 - overlap) / cycle
  (it waited for the part that did not overlap training), engine idle = 1 - generation / cycle.
- Stale tokens: ``async/stale_tokens_age_<a>`` summed over the measured steps over the trained tokens;
  age 0 is the rest. Sync logs none (all its tokens are age 0).
- One rank: ``batch/fed_rows`` is then the whole batch. Generation and training share this process's
  cores; what overlap buys depends on there being cores (or GPUs) for both sides.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

SYNC = "sync"
ARMS: dict[str, list[str]] = {
    SYNC: ["rollout.async_rollout=false"],
    "one_step": ["rollout.async_rollout=true", "rollout.max_staleness=1"],
    "stream_k2": ["rollout.async_rollout=true", "rollout.max_staleness=2"],
    "stream_k4": ["rollout.async_rollout=true", "rollout.max_staleness=4"],
}
STREAMING = ("stream_k2", "stream_k4")
MAX_AGE = 4  # the oldest age any arm can train (stream_k4)
# the job without what prints or writes beside the steps
QUIET = ["trainer.eval_every=0", "logging.progress=false", "logging.tensorboard=false", "logging.charts=false"]
LONG_TAIL_TASK = "task=reasoning_max_digit"  # the task tools/sft_warmstart.py's verbose reasoner learned


@dataclass(frozen=True)
class StepSample:
    """One measured step of one run: what the table pools per arm."""

    arm: str
    cycle_s: float
    trained_tokens: float
    trainer_idle_s: float
    engine_idle_s: float
    tokens_by_age: tuple[float, ...]  # index a: tokens a versions old (0..MAX_AGE)


def arm_overrides(arm: str, mode: str) -> list[str]:
    return ARMS[arm] + ([f"rollout.staleness_mode={mode}"] if arm in STREAMING else [])


def rotated(arms: list[str], repetition: int) -> list[str]:
    """Repetition r runs the arms starting from the r-th: each arm takes each place in turn."""
    shift = repetition % len(arms)
    return arms[shift:] + arms[:shift]


def step_samples(arm: str, records: list[dict], warmup: int) -> list[StepSample]:
    """The measured steps of one run's metrics records (the formulas: module docstring)."""
    from gspo_megatron.run.run_log import RUN_WALL_KEY

    samples = []
    for earlier, record in list(zip(records, records[1:], strict=False))[max(0, warmup - 1) :]:
        cycle = record[RUN_WALL_KEY] - earlier[RUN_WALL_KEY]
        tokens = record["response/length_mean"] * record["batch/fed_rows"]
        if "time/trainer_idle_frac" in record:  # the streaming scheduler measures both sides itself
            trainer_idle = record["time/trainer_idle_frac"] * cycle
            engine_idle = record["time/engine_idle_frac"] * cycle
        else:
            generation = record["time/generation"]
            trainer_idle = generation * (1.0 - record["time/generation_overlap_frac"])
            engine_idle = max(0.0, cycle - generation)
        aged = [record.get(f"async/stale_tokens_age_{age}", 0.0) for age in range(1, MAX_AGE + 1)]
        samples.append(StepSample(arm, cycle, tokens, trainer_idle, engine_idle, (tokens - sum(aged), *aged)))
    return samples


def table(samples: list[StepSample], arms: list[str]) -> str:
    """One row per arm: tokens/s and its ratio to sync, both idle fractions, the trained tokens by age."""
    ages = "".join(f"{f'age {a}':>8}" for a in range(MAX_AGE + 1))
    lines = [f"{'arm':<11}{'steps':>6}{'tokens/s':>10}{'x sync':>8}{'trainer idle':>14}{'engine idle':>13}{ages}"]
    rates: dict[str, float] = {}
    for arm in arms:
        mine = [s for s in samples if s.arm == arm]
        if not mine:
            raise ValueError(f"arm {arm!r} has no measured step: give --steps above --warmup")
        cycle = sum(s.cycle_s for s in mine)
        tokens = sum(s.trained_tokens for s in mine)
        rates[arm] = tokens / cycle
        by_age = [sum(s.tokens_by_age[a] for s in mine) / tokens for a in range(MAX_AGE + 1)]
        lines.append(
            f"{arm:<11}{len(mine):>6}{rates[arm]:>10.1f}{rates[arm] / rates[arms[0]]:>7.2f}x"
            f"{sum(s.trainer_idle_s for s in mine) / cycle:>14.3f}{sum(s.engine_idle_s for s in mine) / cycle:>13.3f}"
            + "".join(f"{fraction:>8.3f}" for fraction in by_age)
        )
    return "\n".join(lines)


def runs_worker(ctx, runs: list[tuple[str, list[str]]], warmup: int) -> list[StepSample]:
    """Every run, in order, in this one rank; each into its own temporary run directory."""
    from gspo_megatron.config.compose import compose
    from gspo_megatron.testing.train_runs import read_metrics
    from gspo_megatron.train import run

    samples: list[StepSample] = []
    for arm, overrides in runs:
        with tempfile.TemporaryDirectory(prefix=f"bench_async_{arm}_") as run_dir:
            run(compose(overrides), run_dir)
            measured = step_samples(arm, read_metrics(run_dir), warmup)
        print(f"{arm}: {len(measured)} measured steps", flush=True)
        samples += measured
    return samples


def main(argv=None) -> None:
    from gspo_megatron.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="trainer.steps of each run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run not measured")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of every arm, interleaved")
    parser.add_argument("--mode", choices=("wait", "drop"), default="wait", help="the streaming arms' staleness_mode")
    parser.add_argument("--warm-start", type=Path, default=None, help="HF checkpoint of tools/sft_warmstart.py")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds all runs together may take")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of every arm, e.g. rollout.max_new_tokens=64")
    args = parser.parse_args(argv)
    if args.reps < 1 or not 0 <= args.warmup < args.steps:
        parser.error("need --reps >= 1 and 0 <= --warmup < --steps")
    if args.warm_start is not None and not (args.warm_start / "config.json").is_file():
        parser.error(f"--warm-start {args.warm_start}: no config.json there; write it with tools/sft_warmstart.py")
    task = [LONG_TAIL_TASK, f"model.hf_checkpoint={args.warm_start.resolve()}"] if args.warm_start else []
    common = [f"trainer.steps={args.steps}", *QUIET, *task, *args.overrides]
    arms = list(ARMS)
    runs = [(arm, [*common, *arm_overrides(arm, args.mode)]) for rep in range(args.reps) for arm in rotated(arms, rep)]
    (samples,) = run_distributed(runs_worker, 1, runs, args.warmup, timeout=args.timeout)
    source = f"warm start {args.warm_start} ({LONG_TAIL_TASK})" if args.warm_start else "random init, default task"
    print(
        f"{args.reps} repetition(s) x {len(arms)} arms, trainer.steps={args.steps} (first {args.warmup} not "
        f"measured), streaming mode {args.mode}; {source}; overrides: {' '.join(args.overrides) or '-'}"
    )
    print(table(samples, arms))
    print("tokens/s: trained response tokens per second of step cycle; ages: fraction of trained tokens")


if __name__ == "__main__":
    main()
