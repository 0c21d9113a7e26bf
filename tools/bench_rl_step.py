"""Per-phase time breakdown of RL steps of the real trainer (default: GSPO, tiny MoE, embedded engine).

    python tools/bench_rl_step.py                                   # 6 steps of conf/config.yaml, 1 rank
    python tools/bench_rl_step.py --steps 4 rollout.max_new_tokens=16 task=reasoning_max_digit
    python tools/bench_rl_step.py --world 2 parallel=tp2           # any Hydra overrides, N gloo ranks

The run is the trainer's own (``trainer.setup.build`` + ``RLTrainer``, composed from ``conf/`` like
``python -m gspo_megatron.train``), in spawned ranks. The trainer already times its phases
(``time/rollout``, ``time/old_logp``, ``time/update``, ``time/weight_sync`` in metrics.jsonl); this
script splits the driver's rollout phase further by wrapping, on the driver's ``RolloutPhase``
instance only, the engine's ``generate`` and the reward scoring, and times the whole ``train_step``:

    generate      engine.generate (sampling, log-probs, routed experts)
    reward        reward pool scoring of the decoded responses
    advantages    rest of the rollout phase: shaping, advantages, packing, broadcast to all ranks
    old_logp      Megatron forward over the batch (routing recorded if replay is on)
    update        mini-batch forward+backward+optimizer steps
    weight_sync   streamed HF export -> engine.update_weights
    other         metrics, routing diagnostics, logging (step time minus the phases above)

The first step (warm-up: allocator, lazy imports) is shown apart; shares are over the later steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

PHASES = ["generate", "reward", "advantages", "old_logp", "update", "weight_sync", "other"]


class _Timed:
    """Wrap a callable; remember the wall time of each call."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)


def bench_worker(ctx, overrides: list[str], run_dir: str, profile_top: int = 0) -> list[dict]:
    """One rank of the run; the driver returns one dict of phase seconds per step. With
    ``profile_top`` the driver also prints cProfile's top functions over the steps after the first."""
    import cProfile
    import pstats
    from pathlib import Path

    from omegaconf import OmegaConf

    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.config.store import register_configs
    from gspo_megatron.config.validate import validate_config
    from gspo_megatron.testing.train_runs import read_metrics
    from gspo_megatron.trainer.setup import build
    from gspo_megatron.trainer.trainer import RLTrainer

    register_configs()
    cfg = compose(overrides)
    typed = to_train_config(cfg)
    validate_config(typed, ctx.world_size)
    components = build(typed, Path(run_dir), OmegaConf.to_yaml(cfg, resolve=True), world_size=ctx.world_size)
    generate = score = None
    if components.mesh.is_driver:
        rollout = components.rollout
        generate = _Timed(rollout.generate_fn or rollout.engine.generate)
        rollout.generate_fn = generate
        score = _Timed(rollout._score)
        rollout._score = score
    trainer = RLTrainer(components)
    step_seconds: list[float] = []
    train_step = trainer.train_step
    profiler = cProfile.Profile() if profile_top and ctx.rank == 0 else None

    def timed_step():
        profiling = profiler is not None and step_seconds  # the first step is warm-up
        if profiling:
            profiler.enable()
        start = time.perf_counter()
        metrics = train_step()
        step_seconds.append(time.perf_counter() - start)
        if profiling:
            profiler.disable()
        return metrics

    trainer.train_step = timed_step
    try:
        trainer.train()
    finally:
        components.close()
    if ctx.rank != 0:
        return []
    if profiler is not None and len(step_seconds) > 1:
        for order in ("tottime", "cumulative"):
            print(f"--- cProfile of steps 2..{len(step_seconds)}, top {profile_top} by {order}", flush=True)
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(order).print_stats(profile_top)
        sys.stdout.flush()
    steps = []
    for record, gen_s, score_s, step_s in zip(read_metrics(run_dir), generate.seconds, score.seconds, step_seconds):
        phases = {
            "generate": gen_s,
            "reward": score_s,
            "advantages": record["time/rollout"] - gen_s - score_s,
            "old_logp": record["time/old_logp"],
            "update": record["time/update"],
            "weight_sync": record["time/weight_sync"],
        }
        phases["other"] = step_s - sum(phases.values())
        phases["step"] = step_s
        steps.append(phases)
    return steps


def format_breakdown(steps: list[dict]) -> str:
    first, later = steps[0], steps[1:] or steps[:1]
    mean = {k: statistics.fmean(s[k] for s in later) for k in PHASES + ["step"]}
    lines = [f"{'phase':<12} {'first step s':>12} {'mean s':>9} {'share':>7}"]
    for phase in PHASES:
        lines.append(f"{phase:<12} {first[phase]:>12.3f} {mean[phase]:>9.3f} {100 * mean[phase] / mean['step']:>6.1f}%")
    lines.append(f"{'step':<12} {first['step']:>12.3f} {mean['step']:>9.3f} {100.0:>6.1f}%")
    lines.append(f"(mean over steps 2..{len(steps)})" if len(steps) > 1 else "(one step: no warm-up excluded)")
    return "\n".join(lines)


def main(argv=None) -> None:
    from gspo_megatron.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--world", type=int, default=1, help="gloo/NCCL ranks (match the parallel= layout)")
    parser.add_argument("--run-dir", default=None, help="default: a temporary directory, removed afterwards")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch threads in each rank")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N (driver)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallel=tp2 algorithm=grpo")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    overrides = [
        f"trainer.steps={args.steps}",
        "trainer.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        *args.overrides,
    ]
    with tempfile.TemporaryDirectory(prefix="bench_rl_step_") as tmp:
        run_dir = args.run_dir or tmp
        results = run_distributed(
            bench_worker,
            args.world,
            overrides,
            run_dir,
            args.profile,
            timeout=args.timeout,
            threads_per_rank=args.threads_per_rank,
        )
    steps = results[0]
    print(f"{args.steps} RL steps, {args.world} rank(s), overrides: {' '.join(overrides)}")
    print(format_breakdown(steps))


if __name__ == "__main__":
    main()
