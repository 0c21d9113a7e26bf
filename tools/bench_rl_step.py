"""Per-phase time breakdown of RL steps of the real trainer (default: GSPO, tiny MoE, embedded engine).

    python tools/bench_rl_step.py                                   # 6 steps of conf/config.yaml, 1 rank
    python tools/bench_rl_step.py --steps 4 rollout.max_new_tokens=16 task=reasoning_max_digit
    python tools/bench_rl_step.py --world 2 parallel=tp2           # any Hydra overrides, N gloo ranks
    python tools/bench_rl_step.py --shape medium --steps 14 --compare-expert-mlp   # grouped vs sequential experts
    python tools/bench_rl_step.py --shape medium --steps 30 --compare-expert-mlp --expert-floor
    python tools/bench_rl_step.py --shape medium --steps 5 --threads-per-rank 2 --gemm-share   # time in GEMMs
    python tools/bench_rl_step.py --steps 22 --compare-over-sample rollout.over_sample=2 rollout.partial=continue \
        rollout.max_staleness=2 task=reasoning_max_digit model.hf_checkpoint=<tools/sft_warmstart.py --long-tail>

The run is the trainer's own (``loop/build.py:build_trainer`` + ``RLTrainer``, composed from ``conf/`` like
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
loop over the same parameters (``policy/models/grouped_experts.py`` subclasses SequentialMLP), starting with
one warm-up step of each. Since every step samples other response lengths, each arm's update and
old-log-prob times are given per 1000 padded tokens of the micro-batches they ran, with the median
and range over its steps (other work on the machine shows up as spread). ``--expert-floor`` adds a
third arm that skips the expert GEMMs (each routed row scaled by its probability): the update time no
expert kernel can beat, hence the largest speed-up over SequentialMLP any expert MLP can give.
``--torch-profile N`` prints torch.profiler's top N operators of the update phase per arm.
``--gemm-share`` profiles the engine's ``generate``, the old-log-prob pass and the update of every step
after the first (rank 0) and prints, per phase, its wall time, its operators' self CPU time, the part
of it spent in matrix products (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``) and
their GFLOP/s: the time no change outside the GEMM kernels can take away (issue 65's floor). The
profiler's bookkeeping slows the steps; the shares, not the step times, are the result.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

PHASES = ["generate", "reward", "advantages", "old_logp", "update", "weight_sync", "other"]
# --compare-over-sample: steps alternate between waiting for every started group and over-sampling
SAMPLING_ARMS = ("all_groups", "over_sample")
EXPERT_ARMS = ("sequential", "grouped")  # --compare-expert-mlp: step i (from 0) runs arm i % len(arms)
NO_EXPERTS = "no_experts"  # --expert-floor: the expert MLP skipped, the update time no expert kernel beats
# --gemm-share: the matrix products among torch's CPU operators (aten::linear and aten::matmul only dispatch to them)
GEMM_OPERATORS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_grouped_mm"}
)
GEMM_PHASES = ("generate", "old_logp", "update")


def _shape_overrides(name: str) -> list[str]:
    from bench_vs_trl import SHAPES  # tools/ is on sys.path when this file runs as a script

    return list(SHAPES[name])


def shadow_method(owner: object, name: str, replacement: Callable[..., Any]) -> None:
    """Replace ``owner.name`` in this process: on an instance, an attribute that shadows the class's
    method for that object only; on a class, the method itself. The benchmarks time the real trainer
    by wrapping its methods instead of adding timing hooks to it; this is the one place that assigns
    to a method (which mypy refuses in plain code, rightly everywhere else)."""
    setattr(owner, name, replacement)


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


def _skip_experts(rows, tokens_per_expert, probs):
    """The expert MLP's interface without its GEMMs: each routed row scaled by its probability."""
    return rows * probs.unsqueeze(-1).to(rows.dtype), None


def _use_expert_mlp(model, arm: str) -> None:
    """Every GroupedExperts of ``model`` (the trainer's ``ModelChunks``) runs its grouped forward,
    SequentialMLP's loop, or (arm ``no_experts``) no expert GEMMs at all."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from gspo_megatron.policy.models.grouped_experts import GroupedExperts

    for module in (m for chunk in model.models for m in chunk.modules()):
        if isinstance(module, GroupedExperts):
            module.__dict__.pop("forward", None)  # back to GroupedExperts' own (grouped) forward
            if arm == "sequential":
                shadow_method(module, "forward", SequentialMLP.forward.__get__(module))
            elif arm == NO_EXPERTS:
                shadow_method(module, "forward", _skip_experts)


def bench_worker(
    ctx,
    overrides: list[str],
    run_dir: str,
    profile_top: int = 0,
    expert_arms: tuple[str, ...] = (),
    torch_profile_top: int = 0,
    sampling_arms: tuple[str, ...] = (),
    gemm_share: bool = False,
) -> list[dict]:
    """One rank of the run; the driver returns one dict of phase seconds per step. With
    ``profile_top`` the driver also prints cProfile's top functions over the steps after the first.
    With ``expert_arms`` the steps take turns over those expert-MLP arms. With ``torch_profile_top``
    rank 0 prints torch.profiler's top operators of the update phase (per arm) over the measured
    steps. With ``sampling_arms`` the steps take turns over waiting for every group (the rollout phase
    without its over-sampling state) and over-sampling (``rollout.over_sample``, with it). With
    ``gemm_share`` rank 0 prints the GEMMs' share of the three profiled phases (``GemmShare``)."""
    import cProfile
    import pstats
    from pathlib import Path

    from omegaconf import OmegaConf

    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.config.store import register_configs
    from gspo_megatron.config.validate import validate_config
    from gspo_megatron.loop.build import build_trainer
    from gspo_megatron.loop.distribute import DriverFeed
    from gspo_megatron.loop.trainer import QuietLog
    from gspo_megatron.run.run_log import open_run_log
    from gspo_megatron.testing.train_runs import read_metrics

    register_configs()
    cfg = compose(overrides)
    typed = to_train_config(cfg)
    validate_config(typed, ctx.world_size)
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    trainer = build_trainer(typed, Path(run_dir), config_yaml, world_size=ctx.world_size)
    generate: _Timed | None = None
    score: _Timed | None = None
    producer = trainer.feed.rollout.producer if isinstance(trainer.feed, DriverFeed) else None  # the driver's
    step_seconds: list[float] = []
    gemms = GemmShare(measured=lambda: bool(step_seconds)) if gemm_share and ctx.rank == 0 else None
    if gemms is not None:
        shadow_method(trainer.policy, "old_log_probs", gemms.wrap("old_logp", trainer.policy.old_log_probs))
    if producer is not None:
        engine_generate = producer.training_engine.generate
        generate = _Timed(engine_generate if gemms is None else gemms.wrap("generate", engine_generate))
        shadow_method(producer.training_engine, "generate", generate)
        score = _Timed(producer._score)
        shadow_method(producer, "_score", score)
        rows = _Timed(producer.engine.generate_rows)  # over-sampling's generation, timed with the other
        rows.seconds = generate.seconds
        shadow_method(producer.engine, "generate_rows", rows)
    over_sampling = producer.partial if producer is not None else None
    if sampling_arms and producer is not None and over_sampling is None:
        raise ValueError("--compare-over-sample needs rollout.over_sample > 1 in the overrides")
    samples_per_step = typed.trainer.prompts_per_step * typed.rollout.group_size
    padded_tokens: list[int] = []  # tokens of the micro-batches this rank ran, per step
    train_step = trainer.train_step
    policy_update = trainer.policy.update if gemms is None else gemms.wrap("update", trainer.policy.update)
    profiler = cProfile.Profile() if profile_top and ctx.rank == 0 else None

    operator_times: dict[str, OperatorTimes] = {}

    def counted_update(step, minibatches, *rest):
        padded_tokens.append(sum(mb.tokens.numel() for minibatch in minibatches for mb in minibatch))
        measured = len(step_seconds) >= max(1, len(expert_arms))  # after the warm-up step(s)
        if not (torch_profile_top and ctx.rank == 0 and measured):
            return policy_update(step, minibatches, *rest)
        arm = expert_arms[len(step_seconds) % len(expert_arms)] if expert_arms else "update"
        with profile_operators(operator_times.setdefault(arm, OperatorTimes())):
            return policy_update(step, minibatches, *rest)

    shadow_method(trainer.policy, "update", counted_update)

    def timed_step():
        profiling = profiler if step_seconds else None  # the first step is warm-up
        if expert_arms:
            _use_expert_mlp(trainer.policy.model, expert_arms[len(step_seconds) % len(expert_arms)])
        if sampling_arms and producer is not None:
            arm = sampling_arms[len(step_seconds) % len(sampling_arms)]
            producer.partial = over_sampling if arm == "over_sample" else None
        if profiling is not None:
            profiling.enable()
        start = time.perf_counter()
        metrics = train_step()
        step_seconds.append(time.perf_counter() - start)
        if profiling is not None:
            profiling.disable()
        return metrics

    shadow_method(trainer, "train_step", timed_step)
    try:
        trainer.train(open_run_log(typed, Path(run_dir), config_yaml) if ctx.rank == 0 else QuietLog())
    finally:
        trainer.close()
    if ctx.rank != 0:
        return []
    if generate is None or score is None:  # rank 0 is the driver, which wrapped both
        raise RuntimeError("bench_rl_step: rank 0 is not the driver, so generate and reward were not timed")
    for arm, times in operator_times.items():
        print(
            f"--- torch.profiler, update phase ({arm}), {times.steps} steps: top {torch_profile_top} by self CPU time"
        )
        print(times.table(torch_profile_top), flush=True)
    if gemms is not None:
        print(f"--- GEMMs per phase, torch.profiler over steps 2..{len(step_seconds)} (rank 0)")
        print(gemms.table(len(step_seconds) - 1), flush=True)
    if profiler is not None and len(step_seconds) > 1:
        for order in ("tottime", "cumulative"):
            print(f"--- cProfile of steps 2..{len(step_seconds)}, top {profile_top} by {order}", flush=True)
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(order).print_stats(profile_top)
        sys.stdout.flush()
    steps = []
    records = zip(read_metrics(run_dir), generate.seconds, score.seconds, step_seconds, padded_tokens, strict=True)
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
        phases["trained_tokens"] = record["response/length_mean"] * samples_per_step
        if expert_arms:
            phases["arm"] = expert_arms[index % len(expert_arms)]
        if sampling_arms:
            phases["arm"] = sampling_arms[index % len(sampling_arms)]
        steps.append(phases)
    return steps


class OperatorTimes:
    """Self CPU time, call count and FLOP (counted only when profiled ``with_flops``) per torch operator, summed
    over several profiled windows."""

    def __init__(self):
        self.self_us: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.flops: dict[str, int] = {}
        self.steps = 0

    def add(self, key_averages) -> None:
        self.steps += 1
        for event in key_averages:
            self.self_us[event.key] = self.self_us.get(event.key, 0.0) + event.self_cpu_time_total
            self.calls[event.key] = self.calls.get(event.key, 0) + event.count
            self.flops[event.key] = self.flops.get(event.key, 0) + (event.flops or 0)

    def table(self, top: int) -> str:
        total = sum(self.self_us.values()) or 1.0
        lines = [f"{'operator':<48} {'self ms/step':>12} {'share':>6} {'calls/step':>10}"]
        for key, us in sorted(self.self_us.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(
                f"{key[:48]:<48} {us / 1000 / self.steps:>12.2f} {100 * us / total:>5.1f}% "
                f"{self.calls[key] / self.steps:>10.0f}"
            )
        lines.append(f"{'all operators':<48} {total / 1000 / self.steps:>12.2f}")
        return "\n".join(lines)


class GemmShare:
    """Per phase, over its profiled calls: wall seconds and the operators' ``OperatorTimes`` (with FLOP), of
    which the matrix products (``GEMM_OPERATORS``) are the share reported."""

    def __init__(self, measured: Callable[[], bool]):
        self.measured = measured  # false during the warm-up step
        self.wall = dict.fromkeys(GEMM_PHASES, 0.0)
        self.operators = {phase: OperatorTimes() for phase in GEMM_PHASES}

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def profiled(*args, **kwargs):
            if not self.measured():
                return fn(*args, **kwargs)
            with profile_operators(self.operators[phase], with_flops=True):
                start = time.perf_counter()
                result = fn(*args, **kwargs)
                self.wall[phase] += time.perf_counter() - start
            return result

        return profiled

    def table(self, steps: int) -> str:
        """Per step (``steps`` profiled): each phase and the three together."""
        rows = {}
        for phase, times in self.operators.items():
            gemm_us = sum(us for key, us in times.self_us.items() if key in GEMM_OPERATORS)
            flop = sum(n for key, n in times.flops.items() if key in GEMM_OPERATORS)
            rows[phase] = (self.wall[phase], sum(times.self_us.values()) / 1e6, gemm_us / 1e6, flop)
        rows["three phases"] = tuple(sum(column) for column in zip(*rows.values(), strict=True))
        lines = [
            f"{'phase':<13} {'wall s':>8} {'operators s':>11} {'GEMM s':>8} {'of wall':>7} {'GFLOP':>7} {'GFLOP/s':>8}"
        ]
        n = max(steps, 1)
        for phase, (wall, operators, gemm, flop) in rows.items():
            lines.append(
                f"{phase:<13} {wall / n:>8.3f} {operators / n:>11.3f} {gemm / n:>8.3f} "
                f"{100 * gemm / max(wall, 1e-12):>6.1f}% {flop / n / 1e9:>7.2f} {flop / max(gemm, 1e-12) / 1e9:>8.1f}"
            )
        lines.append("(per step; wall as profiled: the profiler's bookkeeping lengthens it)")
        return "\n".join(lines)


@contextmanager
def profile_operators(times: OperatorTimes, with_flops: bool = False):
    """torch.profiler (CPU operators) over the block; its per-operator totals are added to ``times``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=with_flops) as prof:
        yield
    times.add(prof.key_averages())


def format_breakdown(steps: list[dict]) -> str:
    first, later = steps[0], steps[1:] or steps[:1]
    mean = {k: statistics.fmean(s[k] for s in later) for k in PHASES + ["step"]}
    lines = [f"{'phase':<12} {'first step s':>12} {'mean s':>9} {'share':>7}"]
    for phase in PHASES:
        lines.append(f"{phase:<12} {first[phase]:>12.3f} {mean[phase]:>9.3f} {100 * mean[phase] / mean['step']:>6.1f}%")
    lines.append(f"{'step':<12} {first['step']:>12.3f} {mean['step']:>9.3f} {100.0:>6.1f}%")
    lines.append(f"(mean over steps 2..{len(steps)})" if len(steps) > 1 else "(one step: no warm-up excluded)")
    return "\n".join(lines)


def ms_per_1k_tokens(rows: list[dict], phase: str, tokens: str) -> tuple[float, list[float]]:
    """``phase``'s milliseconds per 1000 of the steps' ``tokens``: from the totals of ``rows``, and step by step."""
    total = 1e6 * sum(s[phase] for s in rows) / sum(s[tokens] for s in rows)
    return total, [1e6 * s[phase] / s[tokens] for s in rows]


def format_expert_comparison(steps: list[dict], arms: tuple[str, ...]) -> str:
    """Per arm over the steps after the warm-up ones (one per arm): the update and old-log-prob
    phases in ms per 1000 padded tokens (total time / total tokens, and the median, min and max of
    the steps, whose spread shows how much the shared machine disturbed them); then each arm's
    speed-up over sequential from the totals and from the medians."""
    measured = steps[len(arms) :]
    lines = [
        f"{'arm':<11} {'steps':>5} {'update s':>9} {'update ms/1k tok: total':>23} {'median':>7} "
        f"{'min':>7} {'max':>7} {'old_logp ms/1k tok':>18}"
    ]
    per_arm = {}
    for arm in arms:
        rows = [s for s in measured if s["arm"] == arm]
        if not rows:
            return f"the expert comparison needs --steps >= {2 * len(arms)} ({len(arms)} warm-up steps, then each arm)"
        update_per_tok, per_step = ms_per_1k_tokens(rows, "update", "padded_tokens")
        per_arm[arm] = {
            "update": statistics.fmean(s["update"] for s in rows),
            "update_per_tok": update_per_tok,
            "update_median": statistics.median(per_step),
            "old_logp_per_tok": ms_per_1k_tokens(rows, "old_logp", "padded_tokens")[0],
        }
        a = per_arm[arm]
        lines.append(
            f"{arm:<11} {len(rows):>5} {a['update']:>9.3f} {a['update_per_tok']:>23.1f} {a['update_median']:>7.1f} "
            f"{min(per_step):>7.1f} {max(per_step):>7.1f} {a['old_logp_per_tok']:>18.1f}"
        )
    seq = per_arm["sequential"]
    for arm in arms[1:]:
        other = per_arm[arm]
        lines.append(
            f"sequential / {arm}: update per token {seq['update_per_tok'] / other['update_per_tok']:.2f}x "
            f"(medians {seq['update_median'] / other['update_median']:.2f}x), "
            f"old_logp per token {seq['old_logp_per_tok'] / other['old_logp_per_tok']:.2f}x"
        )
    return "\n".join(lines)


def format_over_sample_comparison(steps: list[dict]) -> str:
    """Per arm over the steps after the warm-up ones (one per arm): step and generation seconds per 1000
    trained response tokens (totals, and the median of the steps), and the over-sampling speed-up."""
    measured = steps[len(SAMPLING_ARMS) :]
    lines = [
        f"{'arm':<12} {'steps':>5} {'step s':>7} {'tokens':>7} {'step ms/1k tok':>15} {'median':>7} {'gen ms/1k':>10}"
    ]
    per_arm = {}
    for arm in SAMPLING_ARMS:
        rows = [s for s in measured if s["arm"] == arm]
        if not rows:
            return f"the over-sampling comparison needs --steps >= {2 * len(SAMPLING_ARMS)}"
        step_per_tok, per_step = ms_per_1k_tokens(rows, "step", "trained_tokens")
        per_arm[arm] = (step_per_tok, statistics.median(per_step))
        generate = ms_per_1k_tokens(rows, "generate", "trained_tokens")[0]
        lines.append(
            f"{arm:<12} {len(rows):>5} {statistics.fmean(s['step'] for s in rows):>7.3f} "
            f"{statistics.fmean(s['trained_tokens'] for s in rows):>7.0f} {per_arm[arm][0]:>15.1f} "
            f"{per_arm[arm][1]:>7.1f} {generate:>10.1f}"
        )
    (total, median), (over_total, over_median) = per_arm["all_groups"], per_arm["over_sample"]
    lines.append(
        f"all_groups / over_sample: step time per trained token {total / over_total:.2f}x (medians "
        f"{median / over_median:.2f}x)"
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
        "--torch-profile",
        type=int,
        default=0,
        metavar="N",
        help="print torch.profiler's top N operators of the update phase (per arm with --compare-expert-mlp)",
    )
    parser.add_argument(
        "--shape", choices=["default", "medium"], default="default", help="tools/bench_vs_trl.py's shapes"
    )
    parser.add_argument(
        "--compare-expert-mlp", action="store_true", help="alternate steps: SequentialMLP vs the grouped experts"
    )
    parser.add_argument(
        "--expert-floor",
        action="store_true",
        help="with --compare-expert-mlp: a third arm without expert GEMMs (the update time no expert kernel beats)",
    )
    parser.add_argument(
        "--compare-over-sample",
        action="store_true",
        help="alternate steps: every started group to its end vs rollout.over_sample (set it in the overrides)",
    )
    parser.add_argument(
        "--gemm-share",
        action="store_true",
        help="profile generate, old log-probs and update: each one's time in matrix products, and their GFLOP/s",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallel=tp2 algorithm=grpo")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.expert_floor and not args.compare_expert_mlp:
        parser.error("--expert-floor needs --compare-expert-mlp")
    if args.gemm_share and args.torch_profile:
        parser.error("--gemm-share and --torch-profile each run torch.profiler over the update: pick one")
    arms = (*EXPERT_ARMS, NO_EXPERTS) if args.expert_floor else EXPERT_ARMS if args.compare_expert_mlp else ()
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
            arms,
            args.torch_profile,
            SAMPLING_ARMS if args.compare_over_sample else (),
            args.gemm_share,
            timeout=args.timeout,
            threads_per_rank=args.threads_per_rank,
        )
    steps = results[0]
    print(f"{args.steps} RL steps, {args.world} rank(s), overrides: {' '.join(overrides)}")
    print(format_breakdown(steps))
    if arms:
        print(format_expert_comparison(steps, arms))
    if args.compare_over_sample:
        print(format_over_sample_comparison(steps))


if __name__ == "__main__":
    main()
