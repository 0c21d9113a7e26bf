"""Benchmark forward+backward of the Megatron model per parallel layout, against one rank.

    python tools/bench_model.py                                  # tiny preset, all layouts
    python tools/bench_model.py --layouts single tp2 --batch 16 --seq 128 --repeats 5
    python tools/bench_model.py --preset tiny --hidden-size 256  # a wider model
    python tools/bench_model.py --layouts single cp2 --batch 2 --micro-batches 1 --seq 2048  # long sequence

Every layout is a separate set of spawned ranks (``run_distributed``; gloo on CPU, NCCL on CUDA)
that builds the same model from the same HF-named weights and runs megatron's schedule (1F1B under
PP) forward+backward over the same global batch. Layouts run in one invocation, so the ratios are
against the one-rank baseline measured on the same machine under the same load.

What is reported per layout:
- tokens/s: global batch tokens / wall time of one optimizer-free forward+backward step (median over
  repeats; ranks start together after a barrier; the slowest rank's time counts);
- params MiB/rank: the largest rank's parameter bytes (what sharding saves);
- step peak MiB/rank: the largest rank's peak of memory allocated *during* the step above what
  existed before it (activations, temporaries, logits; the model and DDP's grad buffer are
  allocated beforehand). On CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before
  the step. On CPU: the running total of the CPU allocator's allocations and frees on every thread
  (``testing/memory.py:peak_bytes``, the same method as ``tools/bench_loss_head.py``).

On a machine with fewer cores than ranks the multi-rank layouts time-share cores: their tokens/s
measures communication and scheduling overhead more than speed-up. Each rank uses
``--threads-per-rank`` intra-op threads (default 1) so the layouts get comparable compute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict

from gspo_megatron.testing.memory import peak_bytes

LAYOUTS = {
    "single": dict(world_size=1),
    "tp2": dict(tp=2, world_size=2),
    "pp2": dict(pp=2, world_size=2),
    "ep2": dict(ep=2, world_size=2),
    "tp2_ep2": dict(tp=2, ep=2, world_size=4),
    # context parallel: each rank holds half of every sequence (--seq divisible by 2*cp)
    "cp2": dict(cp=2, world_size=2),
}


def bench_worker(
    ctx, cfg, state: dict, layout_kwargs: dict, batch: int, seq: int, micro_batches: int, warmup: int, repeats: int
) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from gspo_megatron.contracts.micro_batch import MicroBatch
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=1)
    model = build_model(cfg, layout, layer_spec="portable")
    load_hf_weights(model, cfg, state, mesh)
    ddp = wrap_for_training(model, model.config)
    device = mesh.device

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=generator).to(device)
    rows = batch // layout.dp
    mine = tokens[mesh.dp_rank * rows : (mesh.dp_rank + 1) * rows]
    per_micro = rows // micro_batches
    batches = [
        MicroBatch(tokens=mine[i : i + per_micro, :-1].contiguous(), targets=mine[i : i + per_micro, 1:].contiguous())
        for i in range(0, rows, per_micro)
    ]
    total_tokens = batch * seq

    def loss_callback(logits, mb):
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), mb.targets)
        return -logp.sum() / total_tokens, {}

    def step():
        ddp.zero_grad_buffer()
        run_schedule([ddp], batches, loss_callback, forward_only=False)
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
        if i >= warmup:
            times.append(float(elapsed))
    peak = peak_bytes(step, device)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh.destroy()
    return {"times": times, "peak_bytes": peak, "param_bytes": param_bytes, "tokens": total_tokens}


def run_layout(name: str, cfg, state: dict, args) -> dict:
    from gspo_megatron.testing.distributed import run_distributed

    layout = LAYOUTS[name]
    results = run_distributed(
        bench_worker,
        layout["world_size"],
        cfg,
        state,
        layout,
        args.batch,
        args.seq,
        args.micro_batches,
        args.warmup,
        args.repeats,
        timeout=args.timeout,
        threads_per_rank=args.threads_per_rank,
    )
    step_time = statistics.median(results[0]["times"])  # already the max over ranks
    return {
        "layout": name,
        "ranks": layout["world_size"],
        "step_s": step_time,
        "tokens_per_s": results[0]["tokens"] / step_time,
        "param_mib": max(r["param_bytes"] for r in results) / 2**20,
        "peak_mib": max(r["peak_bytes"] for r in results) / 2**20,
    }


def format_table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        f"{'layout':<9} {'ranks':>5} {'step ms':>9} {'tokens/s':>10} {'x 1 rank':>9} "
        f"{'params MiB/rank':>16} {'x':>6} {'step peak MiB/rank':>19} {'x':>6}"
    ]
    for row in rows:
        lines.append(
            f"{row['layout']:<9} {row['ranks']:>5} {1000 * row['step_s']:>9.1f} {row['tokens_per_s']:>10.0f} "
            f"{row['tokens_per_s'] / base['tokens_per_s']:>9.2f} {row['param_mib']:>16.3f} "
            f"{row['param_mib'] / base['param_mib']:>6.2f} {row['peak_mib']:>19.2f} "
            f"{row['peak_mib'] / base['peak_mib']:>6.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    from gspo_megatron.policy.models.config import MoEModelConfig, preset
    from gspo_megatron.testing.model_fixtures import random_hf_state

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--hidden-size", type=int, default=None, help="override the preset's hidden size")
    parser.add_argument("--batch", type=int, default=8, help="global sequences per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batches", type=int, default=2, help="per data-parallel rank")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)

    values = asdict(preset(args.preset))
    if args.hidden_size:
        values["hidden_size"] = args.hidden_size
    cfg = MoEModelConfig(**values)
    for name in args.layouts:
        dp = LAYOUTS[name]["world_size"] // (LAYOUTS[name].get("tp", 1) * LAYOUTS[name].get("pp", 1))
        if args.batch % (dp * args.micro_batches):
            parser.error(
                f"--batch {args.batch} must split into {dp} data-parallel ranks x {args.micro_batches} "
                f"micro-batches (layout {name})"
            )
    if "single" in args.layouts:  # the baseline first
        args.layouts = ["single"] + [n for n in args.layouts if n != "single"]
    state = random_hf_state(cfg, seed=0)
    counts = cfg.parameter_count()
    print(
        f"model {args.preset}: {counts['total']:,} parameters ({counts['active']:,} active), "
        f"batch {args.batch} x {args.seq} tokens, {args.micro_batches} micro-batches/dp rank, "
        f"{args.threads_per_rank} thread(s)/rank, median of {args.repeats}"
    )
    rows = []
    for name in args.layouts:
        rows.append(run_layout(name, cfg, state, args))
        print(f"  {name}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    print(format_table(rows))
    if args.layouts[0] != "single":
        print("(ratios are against the first layout; include 'single' for the one-rank baseline)")


if __name__ == "__main__":
    main()
