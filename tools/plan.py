"""Plan a cluster run: per-rank memory, per-step communication and step time of a parallel layout.

    python tools/plan.py qwen3_30b_a3b tp4_ep8_etp1 --gpus 8            # one layout, in detail
    python tools/plan.py qwen3_30b_a3b rank --gpus 16 --top 5           # rank every valid layout
    python tools/plan.py /models/Qwen3-30B-A3B/config.json tp2_pp2_ep4 --gpus 8 --gpu h200 \\
        --seq-len 16384 --micro-batch-tokens 16384 --recompute --mfu 0.3 --ib-gbps 25

MODEL is a preset of ``models/config.py``, a shape shipped in ``gspo_megatron/planning/hf_configs/``
(``qwen3_235b_a22b``) or a Hugging Face ``config.json`` (file or directory).
LAYOUT is ``rank`` or a name of sizes: ``tp4_pp2_ep8_etp1_cp2`` (omitted sizes are 1; etp defaults
to tp, as in ``parallel.etp=null``; dp fills the GPUs). Layouts are checked with the trainer's own
validation (``config/validate.py``) and refused with its message. Every hardware number is an
assumption printed with the result; override it with the flags below. The model behind the numbers
is ``gspo_megatron/planning/`` (its module docstrings state each formula); what it was checked
against on CPU: tests/distributed/test_planner_matches_megatron.py and tools/bench_plan_memory.py.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from gspo_megatron.models.config import PRESETS, MoEModelConfig, preset
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.planning.hardware import GB, GPUS, gpu_spec
from gspo_megatron.planning.planner import (
    GiB,
    Plan,
    PlanError,
    PlanOptions,
    layout_name,
    plan_layout,
    rank_layouts,
)
from gspo_megatron.routing.replay import REPLAY_MODES

LAYOUT_PART = re.compile(r"^(tp|pp|ep|etp|cp|dp)(\d+)$")


# Shapes shipped for planning only (HF config.json files; no weights): qwen3_235b_a22b.
SHIPPED = Path(__file__).resolve().parent.parent / "gspo_megatron" / "planning" / "hf_configs"


def load_model(spec: str) -> MoEModelConfig:
    if spec in PRESETS:
        return preset(spec)
    if (SHIPPED / f"{spec}.json").is_file():
        return MoEModelConfig.from_hf_config_file(SHIPPED / f"{spec}.json")
    if Path(spec).exists():
        return MoEModelConfig.from_hf_config_file(spec)
    shipped = sorted(p.stem for p in SHIPPED.glob("*.json"))
    raise SystemExit(
        f"MODEL {spec!r} is neither a preset ({sorted(PRESETS)}), a shipped shape ({shipped}) nor a config.json path"
    )


def parse_layout(name: str, gpus: int) -> ParallelLayout:
    sizes: dict[str, int] = {}
    for part in name.split("_"):
        match = LAYOUT_PART.match(part)
        if not match:
            raise SystemExit(f"LAYOUT part {part!r} of {name!r} is not one of tpN ppN epN etpN cpN dpN")
        sizes[match.group(1)] = int(match.group(2))
    dp = sizes.pop("dp", None)
    layout = ParallelLayout(
        world_size=gpus,
        tp=sizes.get("tp", 1),
        pp=sizes.get("pp", 1),
        ep=sizes.get("ep", 1),
        etp=sizes.get("etp"),
        cp=sizes.get("cp", 1),
    )
    if dp is not None and layout.tp * layout.pp * layout.cp * dp != gpus:
        product = layout.tp * layout.pp * layout.cp * dp
        raise SystemExit(f"LAYOUT {name!r}: tp*pp*cp*dp = {product} != --gpus {gpus}")
    return layout


def gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def table_row(plan: Plan) -> str:
    m, t = plan.memory, plan.time
    return (
        f"| {layout_name(plan.layout)} | {plan.micro_batches} | {gib(m.state.parameters)} | "
        f"{gib(m.state.gradients)} | "
        f"{gib(m.state.optimizer)} | {gib(m.activations)} | {gib(m.loss_head)} | {gib(m.total)} | "
        f"{t.total_s:.1f} | {t.bubble_fraction:.0%} | {t.tokens_per_s_per_gpu:,.0f} | "
        f"{'yes' if plan.fits else 'no'} |"
    )


TABLE_HEAD = (
    "| layout | micro-batches | weights GiB | grads GiB | optimizer GiB | activations GiB | loss head GiB | "
    "peak GiB | step s | bubble | tokens/s/GPU | fits |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def print_detail(plan: Plan, gpu) -> None:
    m = plan.memory
    print(
        f"layout {layout_name(plan.layout)}: {plan.micro_batches} micro-batches per dp rank, "
        f"worst stage {plan.worst_stage}"
    )
    print("per-rank memory (GiB), worst stage:")
    for label, value in [
        ("weights (bf16; param buffer with dist. opt.)", m.state.parameters),
        ("gradient buffers (fp32)", m.state.gradients),
        ("optimizer (Adam moments + fp32 master)" + ("" if m.optimizer_on_gpu else ", offloaded"), m.state.optimizer),
        ("activations (micro-batches in flight)", m.activations),
        ("loss head (logits + grad)", m.loss_head),
        ("old-log-prob forward (not concurrent)", m.old_log_prob_pass),
        ("routing replay buffers", m.routing_replay),
        ("peak total", m.total),
    ]:
        print(f"  {label:48s} {gib(value):>8s}")
    print("per-step communication per rank (payload GB, wire GB, seconds):")
    for kind in sorted(plan.traffic.group_size):
        payload = plan.traffic.by_kind()[kind]
        wire = plan.traffic.wire_bytes(kind)
        print(
            f"  {kind:10s} group {plan.traffic.group_size[kind]:3d}  {payload / GB:9.2f} {wire / GB:9.2f} "
            f"{plan.time.comm_s[kind]:8.3f}"
        )
    print(f"  weight sync trainer -> engine (bf16, not in the step time): {plan.sync.describe()}")
    t = plan.time
    print(
        f"step: {t.total_s:.2f} s (compute {t.compute_s:.2f} s, bubble {t.bubble_fraction:.0%}), "
        f"{t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU; fits: {plan.fits} {' '.join(plan.problems)}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("layout", nargs="?", default="rank")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--global-batch-tokens", type=int, default=32 * 8192)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--no-distributed-optimizer", action="store_true")
    parser.add_argument("--optimizer-offload", action="store_true", help="Adam state in host memory")
    parser.add_argument("--recompute", action="store_true", help="full activation recompute")
    parser.add_argument("--routing-replay", choices=list(REPLAY_MODES), default="none")
    parser.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    parser.add_argument("--layer-spec", choices=["te", "portable"], default="te")
    parser.add_argument("--sync-bucket-mib", type=int, default=512, help="rollout.sglang.weight_bucket_bytes")
    parser.add_argument("--max-cp", type=int, default=2, help="largest cp tried when ranking")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    hw = parser.add_argument_group("hardware assumptions (defaults: the --gpu preset)")
    hw.add_argument("--bf16-tflops", type=float)
    hw.add_argument("--memory-gb", type=float)
    hw.add_argument("--nvlink-gbps", type=float, help="GB/s per GPU per direction")
    hw.add_argument("--ib-gbps", type=float, help="GB/s per GPU per direction")
    hw.add_argument("--gpus-per-node", type=int)
    hw.add_argument("--mfu", type=float)
    hw.add_argument("--link-efficiency", type=float)
    args = parser.parse_args(argv)

    scale = lambda v: None if v is None else v * GB
    gpu = gpu_spec(
        args.gpu,
        bf16_tflops=args.bf16_tflops,
        memory_bytes=scale(args.memory_gb),
        nvlink_bandwidth=scale(args.nvlink_gbps),
        ib_bandwidth=scale(args.ib_gbps),
        gpus_per_node=args.gpus_per_node,
        mfu=args.mfu,
        link_efficiency=args.link_efficiency,
    )
    model = load_model(args.model)
    options = PlanOptions(
        seq_len=args.seq_len,
        micro_batch_tokens=args.micro_batch_tokens,
        global_batch_tokens=args.global_batch_tokens,
        group_size=args.group_size,
        dtype=args.dtype,
        distributed_optimizer=not args.no_distributed_optimizer,
        optimizer_offload=args.optimizer_offload,
        recompute=args.recompute,
        routing_replay=args.routing_replay,
        dispatcher=args.dispatcher,
        layer_spec=args.layer_spec,
        sync_bucket_bytes=args.sync_bucket_mib * 2**20,
    )
    counts = model.parameter_count()
    print(
        f"model {args.model}: {counts['total'] / 1e9:.2f}B parameters, "
        f"{counts['active'] / 1e9:.2f}B active; "
        f"{args.gpus} GPUs; {options}"
    )
    print(f"assumptions: {gpu.describe()}")
    if args.layout != "rank":
        try:
            plan = plan_layout(model, parse_layout(args.layout, args.gpus), options, gpu)
        except (PlanError, ValueError) as exc:
            print(f"refused: {exc}")
            return 2
        print_detail(plan, gpu)
        return 0
    plans, too_big = rank_layouts(model, args.gpus, options, gpu, args.max_cp)
    print(
        f"{len(plans)} layouts fit in {gib(gpu.usable_memory_bytes)} GiB, "
        f"{len(too_big)} valid layouts do not; "
        "fitting ones fastest first, then the smallest that do not fit:"
    )
    print(TABLE_HEAD)
    shown = plans[: args.top] + too_big[: max(0, args.top - len(plans))]
    for plan in shown:
        print(table_row(plan))
    return 0 if plans else 1


if __name__ == "__main__":
    sys.exit(main())
