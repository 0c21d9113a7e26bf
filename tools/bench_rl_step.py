"""Per-phase time breakdown of RL steps of the real trainer (default: GSPO, tiny MoE, embedded engine).

    python tools/bench_rl_step.py                                   # 6 steps of conf/config.yaml, 1 rank
    python tools/bench_rl_step.py --steps 4 rollout.max_new_tokens=16 task=reasoning_max_digit
    python tools/bench_rl_step.py --world 2 parallel=tp2           # any Hydra overrides, N gloo ranks
    python tools/bench_rl_step.py --shape medium --steps 14 --compare-expert-mlp   # grouped vs sequential experts

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

``--shape medium`` is the issue's medium shape (``tools/bench_vs_trl.py``: 4 layers, hidden 256, 16
experts top-4, 32 completions of <= 64 tokens, 4 updates per rollout). ``--compare-expert-mlp``
measures the grouped expert MLP against megatron's SequentialMLP in one run: the model is built with
``model.expert_mlp=grouped`` and the steps alternate between its grouped forward and SequentialMLP's
loop over the same parameters (``models/grouped_experts.py`` subclasses SequentialMLP), starting with
one warm-up step of each. Since every step samples other response lengths, each arm's update and
old-log-prob times are also given per 1000 padded tokens of the micro-batches they ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

PHASES = ["generate", "reward", "advantages", "old_logp", "update", "weight_sync", "other"]
EXPERT_ARMS = ("sequential", "grouped")  # --compare-expert-mlp: step i (from 1) runs arm (i - 1) % 2


def _shape_overrides(name: str) -> list[str]:
    from bench_vs_trl import SHAPES  # tools/ is on sys.path when this file runs as a script

    return list(SHAPES[name])


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


def _use_expert_mlp(model, arm: str) -> None:
    """Every GroupedExperts of ``model`` runs its grouped forward, or SequentialMLP's loop."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from gspo_megatron.models.grouped_experts import GroupedExperts

    for module in model.modules():
        if isinstance(module, GroupedExperts):
            vars(module).pop("forward", None)
            if arm == "sequential":
                module.forward = SequentialMLP.forward.__get__(module)


def bench_worker(
    ctx, overrides: list[str], run_dir: str, profile_top: int = 0, compare_expert_mlp: bool = False
) -> list[dict]:
    """One rank of the run; the driver returns one dict of phase seconds per step. With
    ``profile_top`` the driver also prints cProfile's top functions over the steps after the first.
    With ``compare_expert_mlp`` the steps alternate between the two expert-MLP arms."""
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
    padded_tokens: list[int] = []  # tokens of the micro-batches this rank ran, per step
    train_step = trainer.train_step
    policy_updates = trainer._policy_updates
    profiler = cProfile.Profile() if profile_top and ctx.rank == 0 else None

    def counted_updates(parts, *rest):
        padded_tokens.append(sum(mb.tokens.numel() for part in parts for mb in part))
        return policy_updates(parts, *rest)

    trainer._policy_updates = counted_updates

    def timed_step():
        profiling = profiler is not None and step_seconds  # the first step is warm-up
        if compare_expert_mlp:
            _use_expert_mlp(components.model, EXPERT_ARMS[len(step_seconds) % 2])
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
    records = zip(read_metrics(run_dir), generate.seconds, score.seconds, step_seconds, padded_tokens)
    for index, (record, gen_s, score_s, step_s, tokens) in enumerate(records):
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
        phases["padded_tokens"] = tokens
        if compare_expert_mlp:
            phases["arm"] = EXPERT_ARMS[index % 2]
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


def format_expert_comparison(steps: list[dict]) -> str:
    """Per arm over the steps after the first two (one warm-up each): mean seconds of the update and
    old-log-prob phases, and ms per 1000 padded tokens; then sequential / grouped."""
    measured = steps[2:]
    lines = [
        f"{'arm':<11} {'steps':>5} {'update s':>9} {'old_logp s':>10} "
        f"{'update ms/1k tok':>16} {'old_logp ms/1k tok':>18}"
    ]
    per_arm = {}
    for arm in EXPERT_ARMS:
        rows = [s for s in measured if s["arm"] == arm]
        if not rows:
            return "--compare-expert-mlp needs --steps >= 4 (two warm-up steps, then both arms)"
        tokens = sum(s["padded_tokens"] for s in rows) / 1000
        per_arm[arm] = {
            "update": statistics.fmean(s["update"] for s in rows),
            "old_logp": statistics.fmean(s["old_logp"] for s in rows),
            "update_per_tok": 1000 * sum(s["update"] for s in rows) / tokens,
            "old_logp_per_tok": 1000 * sum(s["old_logp"] for s in rows) / tokens,
        }
        a = per_arm[arm]
        lines.append(
            f"{arm:<11} {len(rows):>5} {a['update']:>9.3f} {a['old_logp']:>10.3f} "
            f"{a['update_per_tok']:>16.2f} {a['old_logp_per_tok']:>18.2f}"
        )
    seq, grp = per_arm["sequential"], per_arm["grouped"]
    lines.append(
        f"sequential / grouped: update {seq['update'] / grp['update']:.2f}x "
        f"(per token {seq['update_per_tok'] / grp['update_per_tok']:.2f}x), "
        f"old_logp {seq['old_logp'] / grp['old_logp']:.2f}x "
        f"(per token {seq['old_logp_per_tok'] / grp['old_logp_per_tok']:.2f}x)"
    )
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
    parser.add_argument(
        "--shape", choices=["default", "medium"], default="default", help="tools/bench_vs_trl.py's shapes"
    )
    parser.add_argument(
        "--compare-expert-mlp", action="store_true", help="alternate steps: SequentialMLP vs the grouped experts"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallel=tp2 algorithm=grpo")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    overrides = [
        f"trainer.steps={args.steps}",
        "trainer.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        *_shape_overrides(args.shape),
        *args.overrides,
    ]
    if args.compare_expert_mlp:
        overrides.append("model.expert_mlp=grouped")
    with tempfile.TemporaryDirectory(prefix="bench_rl_step_") as tmp:
        run_dir = args.run_dir or tmp
        results = run_distributed(
            bench_worker,
            args.world,
            overrides,
            run_dir,
            args.profile,
            args.compare_expert_mlp,
            timeout=args.timeout,
            threads_per_rank=args.threads_per_rank,
        )
    steps = results[0]
    print(f"{args.steps} RL steps, {args.world} rank(s), overrides: {' '.join(overrides)}")
    print(format_breakdown(steps))
    if args.compare_expert_mlp:
        print(format_expert_comparison(steps))


if __name__ == "__main__":
    main()
