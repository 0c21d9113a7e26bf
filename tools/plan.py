"""Plan a cluster run: per-rank memory, communication, the RL step's time by phase, and layouts.

    # the job `python -m gspo_megatron.train <overrides>` would run, planned on 8 H100s
    python tools/plan.py model=qwen3_30b_a3b parallel=tp4_ep8 rollout=sglang rollout.sglang.tp=4 \
        trainer.recompute_activations=true algorithm.kl.coef=0.001 --gpus 8 --prompt-tokens 1024
    python tools/plan.py model=qwen3_235b_a22b rollout=sglang rollout.sglang.model_path=/ckpt --gpus 64 --rank
    # a bare model and layout name (no training config: every option a flag)
    python tools/plan.py qwen3_30b_a3b tp4_ep8 --gpus 8 --recompute
    python tools/plan.py /models/Qwen3-30B-A3B/config.json rank --gpus 16 --gpu h200 --mfu 0.25

Config mode (any ``key=value`` argument, or none): the arguments are Hydra overrides of ``conf/``,
composed, typed and validated exactly as the entry point does (``tools/planning/job.py``); every option
(distributed optimizer, dtype, recompute, reference model, old-log-prob pass, updates per rollout,
replay, dispatcher, rollout engine GPUs, sync bucket) comes from that config, and the trainer's
refusal is printed as the trainer words it. ``--rank`` plans every layout of ``--gpus`` for the
same config. Prompt length is data, not config: ``--prompt-tokens`` (an assumption, printed).

Name mode: MODEL is a preset of ``policy/models/config.py``, a shape shipped in
``tools/planning/hf_configs/`` or a Hugging Face ``config.json``; LAYOUT is ``rank``, a
``conf/parallel`` name (``tp4_ep8`` means what ``parallel=tp4_ep8`` means: etp 1) or sizes such as
``tp4_pp2_ep8_etp1_cp2`` (omitted sizes are 1; etp defaults to tp, as ``parallel.etp=null``), with
``firstN``/``lastN`` (decoder layers of the first/last pipeline rank, as megatron's flags and
``parallel.first_stage_layers`` / ``last_stage_layers``: ``tp4_pp4_cp2_ep16_etp1_last22`` is slime's
235B) and ``vpN`` (virtual pipeline chunks per rank: planned, not built by the trainer).

``--calibrate`` (config mode) runs ``--calibrate-steps`` steps of that very job first (the
entry point, or the launcher with --gpus ranks) and replaces the assumptions with what it fitted:
mfu, link efficiency, expert-load imbalance, and on a GPU its capacity and reserve
(``tools/planning/calibrate.py``); the plan that follows uses them.

Every hardware number is an assumption printed with the result (``tools/planning/hardware.py``);
override it with the flags below. What the model was checked against on CPU:
tests/distributed/test_planner_matches_megatron.py and tools/bench_plan_memory.py.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from gspo_megatron.config.compose import CONF_DIR
from gspo_megatron.config.recipes import toy_settings_notice
from gspo_megatron.policy.config import ParallelSection
from gspo_megatron.policy.models.config import PRESETS, MoEModelConfig, preset
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.policy.routing.replay import REPLAY_MODES
from planning.hardware import GB, GPUS, gpu_spec
from planning.job import compose_job, plan_job, rank_job
from planning.planner import (
    GiB,
    Plan,
    PlanError,
    PlanOptions,
    layout_name,
    plan_layout,
    rank_layouts,
)
from planning.step_time import split_prediction

LAYOUT_PART = re.compile(r"^(tp|pp|ep|etp|cp|dp|vp|first|last)(\d+)$")


# Shapes shipped for planning only (HF config.json files; no weights): qwen3_235b_a22b, qwen2_57b_a14b,
# mixtral_8x22b, glm4_5, glm4_5_air, deepseek_v3, kimi_k2.
SHIPPED = Path(__file__).resolve().parent / "planning" / "hf_configs"


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
    named = Path(CONF_DIR) / "parallel" / f"{name}.yaml"
    if named.is_file():  # the shipped layout of that name, exactly as parallel=NAME sets it
        from omegaconf import OmegaConf

        values = OmegaConf.to_container(OmegaConf.load(named))
        assert isinstance(values, dict)
        keys = ParallelSection.LAYOUT_KEYS
        return ParallelLayout(world_size=gpus, **{k: values[k] for k in keys if k in values})
    sizes: dict[str, int] = {}
    for part in name.split("_"):
        match = LAYOUT_PART.match(part)
        if not match:
            raise SystemExit(
                f"LAYOUT part {part!r} of {name!r} is not one of tpN ppN epN etpN cpN dpN vpN firstN lastN"
            )
        sizes[match.group(1)] = int(match.group(2))
    dp = sizes.pop("dp", None)
    layout = ParallelLayout(
        world_size=gpus,
        tp=sizes.get("tp", 1),
        pp=sizes.get("pp", 1),
        ep=sizes.get("ep", 1),
        etp=sizes.get("etp"),
        cp=sizes.get("cp", 1),
        vpp=sizes.get("vp", 1),
        first_stage_layers=sizes.get("first"),
        last_stage_layers=sizes.get("last"),
    )
    if dp is not None and layout.tp * layout.pp * layout.cp * dp != gpus:
        product = layout.tp * layout.pp * layout.cp * dp
        raise SystemExit(f"LAYOUT {name!r}: tp*pp*cp*dp = {product} != --gpus {gpus}")
    return layout


def gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def rl_split(plan: Plan) -> str:
    rl = plan.rl
    assert rl is not None
    return (
        f"{rl.total_s:.0f} ({rl.rollout_s:.0f} / {rl.old_log_prob_s:.0f} / {rl.reference_s:.0f} / "
        f"{rl.updates_s:.0f} / {rl.sync_s:.1f})"
    )


def table_row(plan: Plan) -> str:
    m, t = plan.memory, plan.time
    return (
        f"| {layout_name(plan.layout)} | {plan.micro_batches} | {gib(m.state.parameters)} | "
        f"{gib(m.state.gradients)} | {gib(m.state.optimizer)} | {gib(m.reference_weights)} | "
        f"{gib(m.activations + m.loss_head)} | {gib(plan.peak_bytes)} | {gib(plan.sync.driver_extra_bytes)} | "
        f"{t.lower_s:.0f}-{t.total_s:.0f}{' (tied)' if plan.tied else ''} | {rl_split(plan)} | "
        f"{plan.layout.world_size} + {plan.rollout_gpus} | {'yes' if plan.fits else 'no'} |"
    )


TABLE_HEAD = (
    "| layout | micro-batches | weights | grads | optimizer | reference | activations + loss head | RL-step peak GiB | "
    "sync (driver) | update s | RL step s (rollout / old log-probs / reference / updates / sync) | "
    "GPUs (train + rollout) | fits |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def print_detail(plan: Plan) -> None:
    m = plan.memory
    print(
        f"layout {layout_name(plan.layout)}: {plan.micro_batches} micro-batches per dp rank and update, "
        f"worst stage {plan.worst_stage}"
    )
    print("per-rank memory (GiB), worst stage:")
    for label, value in [
        ("weights (param buffer with dist. opt.)", m.state.parameters),
        ("gradient buffers (fp32)", m.state.gradients),
        (
            "optimizer (Adam moments + fp32 master)"
            + (f", {m.optimizer_off_device / GiB:.1f} of it in host memory" if m.optimizer_offloaded else ""),
            m.state.optimizer,
        ),
        (
            "reference model (algorithm.kl.coef > 0)"
            + (", in host memory between its passes" if m.reference_offloaded else ""),
            m.reference_weights,
        ),
        ("activations (micro-batches in flight)", m.activations),
        ("loss head (logits + grad)", m.loss_head),
        ("forward-only pass (old/ref log-probs; not concurrent)", m.old_log_prob_pass),
        ("routing replay buffers", m.routing_replay),
        ("update phase total (the RL step's peak: below)", m.total),
        ("capacity for counted tensors", plan.capacity),
    ]:
        print(f"  {label:54s} {gib(value):>8s}")
    print("per-update communication per rank (payload GB, wire GB, seconds):")
    for kind in sorted(plan.traffic.group_size):
        payload = plan.traffic.by_kind()[kind]
        wire = plan.traffic.wire_bytes(kind)
        print(
            f"  {kind:10s} group {plan.traffic.group_size[kind]:3d}  {payload / GB:9.2f} {wire / GB:9.2f} "
            f"{plan.time.comm_s[kind]:8.3f}"
        )
    print(f"  weight sync trainer -> engine (bf16): {plan.sync.describe()}")
    t, rl = plan.time, plan.rl
    print(
        f"update: {t.lower_s:.2f}-{t.total_s:.2f} s (communication all hidden .. none hidden; compute "
        f"{t.compute_s:.2f} s, bubble {t.bubble_fraction:.0%}), {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
    )
    if rl is not None:
        rollout = f">= {rl.rollout_s:.1f} (roofline)" if plan.rollout_planned else "not planned (name mode)"
        print(
            f"RL step: {rl.total_s:.1f} s = rollout {rollout} + old log-probs "
            f"{rl.old_log_prob_s:.1f} + reference {rl.reference_s:.1f} + updates {rl.updates_s:.1f} + sync "
            f"{rl.sync_s:.1f}{' (rollout overlapped: async)' if rl.overlapped else ''}; GPUs: "
            f"{plan.layout.world_size} training + {plan.rollout_gpus} rollout = {plan.total_gpus}"
        )
    print_rl_step_memory(plan)
    print(
        f"host memory per node: {gib(plan.host_per_node)} GiB counted (Adam in host memory, the offloaded "
        f"reference; each rank of a node at the worst rank's bytes) of {gib(plan.host_capacity)} GiB"
    )
    print(f"fits: {plan.fits} {' '.join(plan.problems)}")


def print_split(plan: Plan, rollout_gpus: int | None, mean_response_frac: float) -> None:
    """A colocated plan's step against the same GPUs split into training and rollout GPUs, generation
    overlapped with training (rollout.async_rollout, max_staleness k): ``planning.step_time.split_prediction``."""
    rl = plan.rl
    if rl is None or not plan.rollout_planned or plan.rollout_gpus or rl.overlapped:
        return  # nothing to split: the rollout is not planned, or already on GPUs of its own
    gpus = plan.layout.world_size
    if gpus < 2 and rollout_gpus is None:
        return  # one GPU: nothing to split (an explicit --rollout-gpus is refused by split_prediction, naming it)
    p = split_prediction(rl, gpus, rollout_gpus or max(1, gpus // 4), mean_response_frac)
    print(
        f"split {gpus - p.rollout_gpus} training + {p.rollout_gpus} rollout GPUs (each side scaled linearly with "
        f"its GPUs; the trainer's fit on {gpus - p.rollout_gpus} not checked), mean / longest response "
        f"{mean_response_frac:g}: rollout {p.rollout_s:.1f} s a round ({p.filled_rollout_s:.1f} with the tail's "
        f"slots filled), training {p.training_s:.1f} s"
    )
    for k, how in ((0, "taking turns"), (1, "overlapped, a round waits for its longest"), (2, "overlapped, filled")):
        label = "k >= 2" if k == 2 else f"k = {k}"
        print(f"  {label}: {p.split_s(k):.1f} s ({how}) vs colocated {p.colocated_s:.1f} s: {p.speedup(k):.2f}x")


def print_rl_step_memory(plan: Plan) -> None:
    """The whole RL step's peak by phase (tools/planning/rl_step_memory.py): the driver and each stage."""
    ranks = [("driver (rank 0)", plan.driver_memory)] + [(f"stage {i}", m) for i, m in enumerate(plan.rl_memory)]
    print("RL step peak by phase (GiB; resident + held across phases + the phase):")
    for label, m in ranks:
        if m is None:
            continue
        phases = " ".join(f"{name} {gib(m.phase_total(name))}" for name in m.phases)
        print(f"  {label:16s} {phases}  -> peak {gib(m.peak)} ({m.peak_phase})")


def _times(value: float | None, unit: float) -> float | None:
    return None if value is None else value * unit


def hardware(args) -> object:
    def gib_scale(value):
        return _times(value, 2**30)

    def scale(value):
        return _times(value, GB)

    return gpu_spec(
        args.gpu,
        bf16_tflops=args.bf16_tflops,
        memory_bytes=gib_scale(args.memory_gib),
        reserve_bytes=gib_scale(args.reserve_gib),
        host_memory_bytes=gib_scale(args.host_memory_gib),
        nvlink_bandwidth=scale(args.nvlink_gbps),
        pcie_bandwidth=scale(args.pcie_gbps),
        ib_bandwidth=scale(args.ib_gbps),
        gpus_per_node=args.gpus_per_node,
        mfu=args.mfu,
        link_efficiency=args.link_efficiency,
    )


NAME_MODE_ONLY = {  # flags that set what a training config decides; config mode takes the config's
    "seq_len": "rollout.max_new_tokens (+ --prompt-tokens)",
    "micro_batch_tokens": "trainer.micro_batch_size or trainer.micro_batch_tokens",
    "global_batch_tokens": "trainer.prompts_per_step x rollout.group_size / trainer.updates_per_rollout",
    "group_size": "rollout.group_size",
    "dtype": "model.dtype",
    "no_distributed_optimizer": "optimizer.distributed=false",
    "optimizer_offload": "optimizer.cpu_offload=true (and optimizer.offload_fraction)",
    "precision_aware": "optimizer.precision_aware=true",
    "recompute": "trainer.recompute_activations=true",
    "routing_replay": "routing.replay",
    "dispatcher": "model.token_dispatcher",
    "layer_spec": "model.layer_spec",
    "sync_bucket_mib": "rollout.sglang.weight_bucket_bytes",
}


def plan_config(args, gpu) -> int:
    for flag, key in NAME_MODE_ONLY.items():
        if getattr(args, flag) != getattr(DEFAULTS, flag):
            raise SystemExit(f"--{flag.replace('_', '-')} is for a bare model name; with a config set {key}")
    try:
        job = compose_job(args.targets, args.gpus, args.prompt_tokens)
    except ValueError as exc:
        print(f"refused by the trainer's validation: {exc}")
        return 2
    counts = job.config.model.parameter_count()
    print(
        f"model {job.config.model.preset or 'from the config'}: {counts['total'] / 1e9:.2f}B parameters, "
        f"{counts['active'] / 1e9:.2f}B active; {args.gpus} training GPUs"
    )
    notice = toy_settings_notice(job.config)  # the trainer says the same at start-up
    if notice:
        print(notice)
    print("from the config: " + "\n  ".join(job.describe()))
    if args.calibrate:
        job, gpu = run_calibration(args, job, gpu)
    print(f"assumptions: {gpu.describe()}")
    if not args.rank:
        plan = plan_job(job, gpu)
        print_detail(plan)
        print_split(plan, args.rollout_gpus, args.mean_response_frac)
        return 0
    return print_ranking(*rank_job(job, gpu, args.max_cp), gpu, args.top)


def run_calibration(args, job, gpu):
    """Run the job for ``--calibrate-steps`` steps, print the fit, return the job and GPU it fitted."""
    import dataclasses
    import tempfile

    from planning.calibrate import calibrate, describe

    work = Path(args.calibrate_dir) if args.calibrate_dir else Path(tempfile.mkdtemp(prefix="gspo_calibrate_"))
    print(f"calibrating: {args.calibrate_steps} steps of the job in {work} ...", flush=True)
    cal = calibrate(job, args.targets, gpu, args.calibrate_steps, work)
    print("calibration:\n  " + "\n  ".join(describe(cal)))
    if args.calibrate_out:
        Path(args.calibrate_out).write_text(json.dumps(dataclasses.asdict(cal), indent=2))
    if cal.expert_imbalance is not None:
        job = dataclasses.replace(job, options=dataclasses.replace(job.options, expert_imbalance=cal.expert_imbalance))
    return job, cal.spec(gpu)


def print_ranking(plans: list[Plan], too_big: list[Plan], gpu, top: int) -> int:
    tied = sum(p.tied for p in plans)
    print(
        f"{len(plans)} layouts fit in {gib(gpu.usable_memory_bytes)} GiB ({tied} tied with the fastest: their "
        f"update-time bands overlap; most headroom first), {len(too_big)} valid layouts do not:"
    )
    print(TABLE_HEAD)
    for plan in plans[:top] + too_big[: max(0, top - len(plans))]:
        print(table_row(plan))
    return 0 if plans else 1


def plan_name(args, gpu) -> int:
    if len(args.targets) not in (1, 2):
        raise SystemExit("name mode takes MODEL [LAYOUT]; config mode takes key=value overrides")
    if args.calibrate:
        raise SystemExit("--calibrate runs a training job: give its config overrides (key=value), not a model name")
    model = load_model(args.targets[0])
    layout_arg = args.targets[1] if len(args.targets) == 2 else "rank"
    layer_spec = args.layer_spec
    if model.portable_spec_only and layer_spec == "te":  # the trainer builds it so (model.layer_spec=auto)
        print(f"model {args.targets[0]}: planned with the portable layer spec, the only one that builds it")
        layer_spec = "portable"
    options = PlanOptions(
        seq_len=args.seq_len,
        micro_batch_tokens=args.micro_batch_tokens,
        global_batch_tokens=args.global_batch_tokens,
        group_size=args.group_size,
        dtype=args.dtype,
        distributed_optimizer=not args.no_distributed_optimizer,
        optimizer_offload=1.0 if args.optimizer_offload else 0.0,
        precision_aware=args.precision_aware,
        recompute=args.recompute,
        routing_replay=args.routing_replay,
        dispatcher=args.dispatcher,
        layer_spec=layer_spec,
        sync_bucket_bytes=args.sync_bucket_mib * 2**20,
    )
    counts = model.parameter_count()
    print(
        f"model {args.targets[0]}: {counts['total'] / 1e9:.2f}B parameters, "
        f"{counts['active'] / 1e9:.2f}B active; {args.gpus} GPUs; {options}"
    )
    print(f"assumptions: {gpu.describe()}")
    if layout_arg != "rank":
        try:
            plan = plan_layout(model, parse_layout(layout_arg, args.gpus), options, gpu)
        except (PlanError, ValueError) as exc:
            print(f"refused: {exc}")
            return 2
        print_detail(plan)
        return 0
    return print_ranking(*rank_layouts(model, args.gpus, options, gpu, args.max_cp), gpu, args.top)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", help="key=value overrides, or MODEL [LAYOUT]")
    parser.add_argument("--gpus", type=int, default=8, help="training GPUs (the world size)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument("--rank", action="store_true", help="config mode: plan every layout of --gpus")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="config mode: longest prompt (assumed)")
    parser.add_argument("--max-cp", type=int, default=2, help="largest cp tried when ranking")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument(
        "--rollout-gpus",
        type=int,
        default=None,
        help="config mode, colocated rollout: also predict the same GPUs split, this many for rollout (default 1/4)",
    )
    parser.add_argument(
        "--mean-response-frac",
        type=float,
        default=1.0,
        help="with the split: mean / longest response length (a long tail; 1: none, the roofline's assumption)",
    )
    cal = parser.add_argument_group("calibration (config mode): run the job, fit mfu, link efficiency, imbalance")
    cal.add_argument("--calibrate", action="store_true", help="run --calibrate-steps steps of the job and fit")
    cal.add_argument("--calibrate-steps", type=int, default=4, help="the first warms up, the last is diagnosed")
    cal.add_argument("--calibrate-dir", help="where the calibration run writes (default: a new temp dir)")
    cal.add_argument("--calibrate-out", help="write the fit as JSON here")
    name = parser.add_argument_group("name mode (MODEL LAYOUT): what a training config would set")
    name.add_argument("--seq-len", type=int, default=8192)
    name.add_argument("--micro-batch-tokens", type=int, default=16384)
    name.add_argument("--global-batch-tokens", type=int, default=32 * 8192)
    name.add_argument("--group-size", type=int, default=8)
    name.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    name.add_argument("--no-distributed-optimizer", action="store_true")
    name.add_argument("--optimizer-offload", action="store_true", help="Adam state in host memory")
    name.add_argument("--precision-aware", action="store_true", help="no fp32 main shards (the optimizer's own)")
    name.add_argument("--recompute", action="store_true", help="full activation recompute")
    name.add_argument("--routing-replay", choices=list(REPLAY_MODES), default="none")
    name.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    name.add_argument("--layer-spec", choices=["te", "portable"], default="te")
    name.add_argument("--sync-bucket-mib", type=int, default=512, help="rollout.sglang.weight_bucket_bytes")
    hw = parser.add_argument_group("hardware assumptions (defaults: the --gpu preset)")
    hw.add_argument("--bf16-tflops", type=float)
    hw.add_argument("--memory-gib", type=float, help="what torch can allocate per GPU")
    hw.add_argument("--reserve-gib", type=float, help="CUDA context, NCCL, fragmentation")
    hw.add_argument("--host-memory-gib", type=float, help="host RAM per node")
    hw.add_argument("--nvlink-gbps", type=float, help="GB/s per GPU per direction")
    hw.add_argument("--pcie-gbps", type=float, help="host <-> GPU, GB/s per GPU per direction")
    hw.add_argument("--ib-gbps", type=float, help="GB/s per GPU per direction")
    hw.add_argument("--gpus-per-node", type=int)
    hw.add_argument("--mfu", type=float)
    hw.add_argument("--link-efficiency", type=float)
    return parser


DEFAULTS = build_parser().parse_args([])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    gpu = hardware(args)
    config_mode = not args.targets or any("=" in t for t in args.targets)
    return plan_config(args, gpu) if config_mode else plan_name(args, gpu)


if __name__ == "__main__":
    sys.exit(main())
