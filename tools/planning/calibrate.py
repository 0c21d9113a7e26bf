"""``tools/plan.py --calibrate``: run the configured job for a few steps and fit the planner's free
parameters to what it measured.

What is fitted, and from what (the first step is left out: allocation, warm caches):
- **mfu** from the update phase. The planner's update time is ``C / mfu + M`` (C: compute at mfu 1,
  M: communication at the link efficiency below; ``step_time.py``), planned on the shape the steps
  really fed (``batch/fed_rows``, ``batch/fed_tokens``, ``batch/micro_batches_per_rank``: padding
  and the trainer's micro-batching included), so ``mfu = C / (t_update - M)``. The peak it is a
  fraction of: on a GPU the preset's dense bf16 peak (the planner's own definition); on CPU, where
  no vendor figure exists, this machine's measured dense GEMM rate in the model's dtype (a 2048^3
  matmul, best of 5) divided by the ranks that share its cores.
- **link efficiency** from an all-reduce timed on the job's world size (gloo on CPU, NCCL on GPU) at
  the step's data-parallel gradient size (clamped to 1..64 MiB): ring bandwidth ``2(n-1)/n x bytes /
  s`` over the link the planner assigns to a group inside one node (NVLink); on CPU that link is this
  machine's measured memory-copy bandwidth (gloo's ranks on one host exchange through memory). One
  rank has no collective: the preset's value is kept, and said so.
- **expert-load imbalance** from the ``update`` routing diagnostic's per-layer expert loads
  (``routing.jsonl``): for an expert-parallel size ep, the busiest EP rank's share of a layer's routed
  rows times ep (megatron places experts contiguously: rank r holds experts [r E/ep, (r+1) E/ep)),
  averaged over layers and diagnosed steps. The planner scales the critical rank's expert FLOPs by it.
  The calibration run diagnoses only its last step (``routing.kinds=[update]``), and the steps whose
  diagnostics ran are left out of the timings (their extra forward is not in the time model).
- **capacity and reserve** on a GPU: ``total_memory`` of the device and the gap between the largest
  ``max_memory_reserved`` and ``max_memory_allocated`` of any rank (``policy/device_memory.py``);
  on CPU the host's physical memory over the ranks, no reserve.
Held out, printed beside the fit: the old-log-prob pass (forward-only), rollout, sync and, on a GPU,
the measured peak against the planner's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from gspo_megatron.policy.parallel.device import cuda_kernels
from planning.hardware import GPUSpec
from planning.job import PlannedJob
from planning.planner import Plan, plan_layout

MiB = 2**20
PHASES = ("rollout", "old_logp", "ref_logp", "update", "weight_sync")
GEMM_SIZE = 2048


@dataclass(frozen=True)
class MeasuredStep:
    """One calibration step from ``metrics.jsonl``: phase seconds and the shape it fed."""

    step: int
    seconds: dict[str, float]
    fed_rows: int
    fed_tokens: int
    micro_batches_per_rank: int
    max_allocated_bytes: float | None = None
    max_reserved_bytes: float | None = None


@dataclass(frozen=True)
class Calibration:
    device: str
    peak_flops: float  # per rank: the preset's bf16 peak (GPU) or this machine's GEMM rate / ranks (CPU)
    peak_source: str
    mfu: float | None
    link_bytes_per_s: float | None  # achieved ring bandwidth of the timed all-reduce
    link_nominal: float  # the link it is a fraction of
    link_efficiency: float | None
    expert_imbalance: float | None  # at the job's expert-parallel size
    imbalance_by_ep: dict[int, float] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)  # median phase seconds over the timed steps
    timed_steps: list[int] = field(default_factory=list)
    predicted: dict[str, float] = field(default_factory=dict)  # the same phases, planned with the fit
    memory: dict[str, float] = field(default_factory=dict)  # GPU: measured peaks, capacity, planned peak
    notes: list[str] = field(default_factory=list)

    def spec(self, base: GPUSpec) -> GPUSpec:
        """``base`` with every fitted number in place (what was not fitted keeps the preset's value)."""
        return fitted_spec(base, self)


# --------------------------------------------------------------------------- reading the run
def read_steps(run_dir: Path) -> list[MeasuredStep]:
    steps = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        steps.append(
            MeasuredStep(
                step=int(m["step"]),
                seconds={p: float(m[f"time/{p}"]) for p in PHASES if f"time/{p}" in m},
                fed_rows=int(m["batch/fed_rows"]),
                fed_tokens=int(m["batch/fed_tokens"]),
                micro_batches_per_rank=int(m["batch/micro_batches_per_rank"]),
                max_allocated_bytes=m.get("memory/max_allocated_bytes"),
                max_reserved_bytes=m.get("memory/max_reserved_bytes"),
            )
        )
    return steps


def read_expert_loads(run_dir: Path) -> tuple[list[list[list[float]]], set[int]]:
    """The ``update`` diagnostic's [L x E] load fractions per diagnosed step, and every step any
    diagnostic ran on (their timings hold extra forwards)."""
    path = run_dir / "routing.jsonl"
    loads: list[list[list[float]]] = []
    diagnosed: set[int] = set()
    if not path.is_file():
        return loads, diagnosed
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        diagnosed.add(int(record["step"]))
        if record["kind"] == "update" and "expert_load" in record:
            loads.append(record["expert_load"])
    return loads, diagnosed


def expert_imbalance(loads: list[list[list[float]]], ep: int) -> float:
    """mean over steps and layers of ``ep x max_r sum(load of rank r's experts)``; 1 = balanced.

    ``loads[s][l][e]`` is expert e's fraction of layer l's routed rows (each layer sums to 1).
    """
    values = []
    for step in loads:
        for layer in step:
            experts = len(layer)
            if experts % ep:
                raise ValueError(f"{experts} experts do not split over ep={ep}")
            per_rank = experts // ep
            shares = [sum(layer[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
            values.append(ep * max(shares) / sum(shares))
    if not values:
        raise ValueError("no expert loads to measure the imbalance from")
    return statistics.fmean(values)


def median_phases(steps: list[MeasuredStep]) -> dict[str, float]:
    return {p: statistics.median(s.seconds[p] for s in steps) for p in PHASES if all(p in s.seconds for s in steps)}


# --------------------------------------------------------------------------- the time model's fit
def fed_options(job: PlannedJob, step: MeasuredStep):
    """The job's plan options with the batch shape replaced by what the step fed (per update, per rank)."""
    options, dp = job.options, job.layout.dp
    updates = options.updates_per_rollout
    width = max(1, round(step.fed_tokens / step.fed_rows))
    rows_per_update = step.fed_rows // updates
    micro_batches = max(1, step.micro_batches_per_rank // updates)
    rows_per_micro = max(1, -(-rows_per_update // dp) // micro_batches)
    rollout = options.rollout
    if rollout is not None:  # the prompts that ran, not the assumed length (fed = prompt + response - 1)
        rollout = replace(rollout, prompt_tokens=max(1, width + 1 - rollout.response_tokens))
    return replace(
        options,
        rollout=rollout,
        seq_len=width,
        micro_batch_tokens=rows_per_micro * width,
        global_batch_tokens=rows_per_micro * micro_batches * dp * width,
    )


def fit_mfu(job: PlannedJob, step: MeasuredStep, spec: GPUSpec, update_s: float) -> tuple[float | None, str]:
    """``mfu = C / (t - M)`` with C and M from two plans of the fed shape (see the module docstring)."""
    options = fed_options(job, step)
    one = plan_layout(job.config.model, job.layout, options, replace(spec, mfu=1.0), validated=True).time.total_s
    half = plan_layout(job.config.model, job.layout, options, replace(spec, mfu=0.5), validated=True).time.total_s
    compute, comm = half - one, 2 * one - half
    per_update = update_s / options.updates_per_rollout
    if per_update <= comm:
        return None, (
            f"not fitted: the planned communication ({comm:.4f} s) alone exceeds the measured update "
            f"({per_update:.4f} s); the link efficiency overestimates the time"
        )
    return compute / (per_update - comm), ""


def fitted_spec(base: GPUSpec, cal: Calibration) -> GPUSpec:
    changes: dict[str, Any] = {"bf16_tflops": cal.peak_flops / 1e12}
    if cal.mfu is not None:
        changes["mfu"] = cal.mfu
    if cal.link_efficiency is not None:
        changes["link_efficiency"] = cal.link_efficiency
    if cal.device == "cpu":  # the measured copy bandwidth is this machine's "link" and memory bandwidth
        changes.update(nvlink_bandwidth=cal.link_nominal, ib_bandwidth=cal.link_nominal, hbm_bandwidth=cal.link_nominal)
        changes.update(reserve_bytes=0.0)  # no CUDA context or caching allocator
    if "capacity_bytes" in cal.memory:
        changes["memory_bytes"] = cal.memory["capacity_bytes"]
    if "reserved_gap_bytes" in cal.memory:
        changes["reserve_bytes"] = cal.memory["reserved_gap_bytes"]
    return replace(base, name=f"{base.name} (calibrated on {cal.device})", **changes)


# --------------------------------------------------------------------------- machine measurements
def gemm_flops(dtype: torch.dtype, device: torch.device, size: int = GEMM_SIZE, repeats: int = 5) -> float:
    """Best-of-``repeats`` FLOP/s of one ``size``^3 matmul: 2 size^3 / seconds."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms the kernels up
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def copy_bandwidth(device: torch.device, nbytes: int = 64 * MiB, repeats: int = 5) -> float:
    """Best-of-``repeats`` bytes/s of a tensor copy (read + write counted once: the bytes moved)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce_worker(rank: int, world: int, store_path: str, nbytes: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    cuda = cuda_kernels()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            dist.all_reduce(tensor)
            _sync(device)
            times.append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(json.dumps(min(times[1:])))
    finally:
        dist.destroy_process_group()


def all_reduce_seconds(world: int, nbytes: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` seconds of one all-reduce of ``nbytes`` over ``world`` fresh processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds.json")
        mp.start_processes(
            _all_reduce_worker,
            args=(world, os.path.join(tmp, "store"), nbytes, repeats, out),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return float(json.loads(Path(out).read_text()))


# --------------------------------------------------------------------------- the run
def calibration_overrides(run_dir: Path, steps: int) -> list[str]:
    """What the calibration run changes of the configured job: its length, where it writes, no
    evaluation or intermediate checkpoint, no charts or TensorBoard (only numbers are read), and the
    ``update`` diagnostic on the last step only."""
    return [
        "logging.charts=false",
        "logging.tensorboard=false",
        f"trainer.steps={steps}",
        f"run_dir={run_dir}",
        "trainer.eval_every=0",
        "checkpoint.save_every=0",
        "routing.enabled=true",
        "routing.kinds=[update]",
        f"routing.every_n_steps={steps - 1}",  # the trainer's 0-based steps 0 and steps-1: logged 1 and the last
    ]


def run_job(overrides: list[str], world: int, run_dir: Path, steps: int, log: Path) -> None:
    """The job as ``python -m gspo_megatron.train`` (one rank) or the project's launcher runs it."""
    entry = (
        ["-m", "gspo_megatron.train"] if world == 1 else ["-m", "gspo_megatron.launcher", f"--nproc-per-node={world}"]
    )
    cmd = [sys.executable, *entry, *overrides, *calibration_overrides(run_dir, steps)]
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the calibration run failed ({done.returncode}); its log: {log}\n{' '.join(cmd)}")


def calibrate(job: PlannedJob, overrides: list[str], base: GPUSpec, steps: int, work_dir: Path) -> Calibration:
    """Run ``steps`` steps of the job in ``work_dir`` and fit (see the module docstring)."""
    if steps < 3:
        raise ValueError(f"--calibrate-steps={steps} must be >= 3 (the first warms up, the last is diagnosed)")
    world = job.layout.world_size
    cuda = cuda_kernels()
    if cuda and torch.cuda.device_count() < world:
        raise ValueError(f"--gpus {world} but this machine has {torch.cuda.device_count()} GPU(s)")
    run_dir = work_dir / "run"
    work_dir.mkdir(parents=True, exist_ok=True)
    job = _as_built_here(job)
    run_job(overrides, world, run_dir, steps, work_dir / "calibration.log")
    all_steps = read_steps(run_dir)
    loads, diagnosed = read_expert_loads(run_dir)
    timed = [s for s in all_steps if s.step != 1 and s.step not in diagnosed]
    if not timed:
        raise RuntimeError(f"no undiagnosed step after the first in {run_dir}: raise --calibrate-steps")
    measured = median_phases(timed)
    notes: list[str] = []

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = getattr(torch, job.options.dtype)
    if cuda:
        peak, source = base.bf16_tflops * 1e12, f"{base.name} dense bf16 peak (preset)"
        nominal = base.nvlink_bandwidth
    else:
        machine = gemm_flops(dtype, device)
        peak = machine / world
        source = f"this CPU's {GEMM_SIZE}^3 {job.options.dtype} GEMM rate {machine / 1e9:.1f} GFLOP/s / {world} rank(s)"
        nominal = copy_bandwidth(device)

    link_rate = efficiency = None
    if world > 1:
        grads = plan_layout(job.config.model, job.layout, job.options, base, validated=True).memory.state.gradients
        nbytes = int(min(max(grads, MiB), 64 * MiB)) // 4 * 4
        seconds = all_reduce_seconds(world, nbytes)
        link_rate = 2 * (world - 1) / world * nbytes / seconds
        efficiency = link_rate / nominal
    else:
        notes.append("link efficiency: one rank runs no collective; the preset's value is kept")

    imbalance_by_ep: dict[int, float] = {}
    imbalance = None
    experts = job.config.model.num_experts
    if loads and experts:
        imbalance_by_ep = {ep: expert_imbalance(loads, ep) for ep in range(1, experts + 1) if experts % ep == 0}
        imbalance = imbalance_by_ep[job.layout.ep]
    elif experts:
        notes.append("expert imbalance: the run wrote no expert loads (routing.jsonl); not fitted")

    cal = Calibration(
        device=str(torch.cuda.get_device_name(0)) if cuda else "cpu",
        peak_flops=peak,
        peak_source=source,
        mfu=None,
        link_bytes_per_s=link_rate,
        link_nominal=nominal,
        link_efficiency=efficiency,
        expert_imbalance=imbalance,
        imbalance_by_ep=imbalance_by_ep,
        measured=measured,
        timed_steps=[s.step for s in timed],
        notes=notes,
    )
    step = timed[-1]
    job = _with_imbalance(job, imbalance)
    mfu, why = fit_mfu(job, step, fitted_spec(base, cal), measured["update"])
    if why:
        notes.append(f"mfu: {why}")
    cal = replace(cal, mfu=mfu)
    spec = fitted_spec(base, cal)
    plan = plan_layout(job.config.model, job.layout, fed_options(job, step), spec, validated=True)
    predicted = _predicted_phases(plan)
    memory: dict[str, float] = {}
    peaks = [s.max_allocated_bytes for s in all_steps if s.max_allocated_bytes is not None]
    if cuda and peaks:
        reserved = max(s.max_reserved_bytes or 0.0 for s in all_steps)
        memory = {
            "capacity_bytes": float(torch.cuda.get_device_properties(0).total_memory),
            "max_allocated_bytes": max(peaks),
            "max_reserved_bytes": reserved,
            "reserved_gap_bytes": reserved - max(peaks),
            "planned_peak_bytes": float(plan.peak_bytes),
        }
    elif not cuda:  # the ranks share the host's memory
        memory = {"capacity_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world}
    return replace(cal, predicted=predicted, memory=memory)


def _as_built_here(job: PlannedJob) -> PlannedJob:
    """The layer spec this machine builds (``model.layer_spec=auto``: TE only with CUDA and the package)."""
    from gspo_megatron.policy.models.builder import resolve_spec_name

    built = resolve_spec_name(str(job.config.model.layer_spec))
    return replace(job, options=replace(job.options, layer_spec="te" if built == "te" else "portable"))


def _with_imbalance(job: PlannedJob, imbalance: float | None) -> PlannedJob:
    return job if imbalance is None else replace(job, options=replace(job.options, expert_imbalance=imbalance))


def _predicted_phases(plan: Plan) -> dict[str, float]:
    rl = plan.rl
    assert rl is not None
    return {
        "rollout": rl.rollout_s,
        "old_logp": rl.old_log_prob_s,
        "ref_logp": rl.reference_s,
        "update": rl.updates_s,
        "weight_sync": rl.sync_s,
    }


def describe(cal: Calibration) -> list[str]:
    """The fitted parameters and the phases, measured beside planned-with-the-fit."""

    def fmt(value: float | None, pattern: str) -> str:
        return "not fitted" if value is None else pattern.format(value)

    lines = [
        f"device: {cal.device}; peak per rank {cal.peak_flops / 1e12:.4f} TFLOP/s ({cal.peak_source})",
        f"fitted mfu: {fmt(cal.mfu, '{:.3f}')} (fraction of that peak in the update phase)",
        f"fitted link efficiency: {fmt(cal.link_efficiency, '{:.3f}')} (all-reduce "
        f"{fmt(cal.link_bytes_per_s and cal.link_bytes_per_s / 1e9, '{:.2f} GB/s')} of "
        f"{cal.link_nominal / 1e9:.2f} GB/s nominal)",
        f"fitted expert imbalance at this layout's ep: {fmt(cal.expert_imbalance, '{:.3f}')}; by ep: "
        + ", ".join(f"ep{ep} {v:.3f}" for ep, v in sorted(cal.imbalance_by_ep.items())),
        f"phases (s, median of steps {cal.timed_steps}): measured / planned with the fit",
    ]
    for phase in PHASES:
        if phase in cal.measured:
            got, planned = cal.measured[phase], cal.predicted.get(phase, 0.0)
            held = "" if phase == "update" else " (held out)"
            lines.append(f"  {phase:12s} {got:9.4f} / {planned:9.4f}{held}")
    if "max_allocated_bytes" in cal.memory:
        m = cal.memory
        lines.append(
            f"memory: max allocated {m['max_allocated_bytes'] / 2**30:.2f} GiB "
            f"(planned {m['planned_peak_bytes'] / 2**30:.2f}), "
            f"reserved {m['max_reserved_bytes'] / 2**30:.2f} GiB, capacity {m['capacity_bytes'] / 2**30:.2f} GiB"
        )
    else:
        lines.append(
            f"memory: capacity {cal.memory.get('capacity_bytes', 0) / 2**30:.2f} GiB per rank (the host's / ranks); "
            "no device peaks on CPU (tests/distributed measures the CPU allocator's peak)"
        )
    lines += [f"note: {n}" for n in cal.notes]
    return lines
