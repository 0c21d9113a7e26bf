"""The GPU day in one command, on the lent machine, from the checkout's root (python3 there is the image's):

    python3 tools/gpu_day.py              # install the kit offline, run the GPU steps, report into $OUT
    python3 tools/gpu_day.py --dry-run    # the same up to the CUDA check, then stop (this machine's test)

Steps, each under its time box, 480 s in all (the device tool allows 600 s a command):
    install 30 | preflight 60 | cuda 15 | gpu_tier 225 | main_job 75 | calibrate 75
- install: the kit (``.gpu_kit/``, built here by ``tools/gpu_kit.py build``) with ``pip --no-index``;
- preflight: import what the steps import, print the versions the image really has;
- cuda: ``torch.cuda.is_available()`` and the device's name;
- gpu_tier: ``pytest tests/gpu`` but the calibration (NCCL placement, bf16 against fp32, grouped experts
  through ``torch._grouped_mm`` on Hopper, the offloaded reference, HybridDeviceOptimizer's host side with
  the distributed optimizer, CUDA-IPC handles read in another process);
- main_job: the main job (``python -m gspo_megatron.train``), shortened to ``MAIN_JOB_STEPS`` steps: the
  trainer picks CUDA wherever a GPU is visible (``policy/parallel/device.py``; no config key selects it);
- calibrate: ``tests/gpu/test_calibrate_gpu.py`` (``tools/plan.py --calibrate`` on one GPU against the
  trainer's measured bytes), with ``-s`` so the fit it prints reaches the report.

Design decisions:
- Standard library only: it runs before the kit is installed.
- The kit installs into the interpreter's own environment with pip's resolver on (``--no-index
  --find-links``): the image's packages count as installed, so the image's torch stays, and a kit that
  misses a dependency fails the install step naming it, not an import minutes later.
- The project is not installed: every step runs with ``PYTHONPATH`` = the checkout (the configs are found
  there as ``pkg://gspo_megatron.conf``; the tools import their siblings), and with ``HF_HUB_OFFLINE=1``
  (that machine reaches no hub: a lookup fails at once instead of waiting out its time box).
- Each step runs in its own process session; when its box runs out the whole session (pytest's ranks,
  the trainer's engine) gets SIGTERM, then SIGKILL after ``TERM_GRACE_S``.
- A failing GPU step does not stop the next (they are independent); a failing install, preflight or
  CUDA check does, since nothing after it can run.
- Without CUDA: ``--dry-run`` stops at the CUDA check with the verdict "dry run", exit 0; without
  ``--dry-run`` the missing device is a failure (exit 1), so a lent machine whose GPU is not seen
  never reads as a success.
- Reports: ``gpu_day.json`` and ``gpu_day.txt`` in ``--out`` (default ``$OUT``, the folder the device
  tool sends back), and each step's whole output as ``<step>.log`` there (2 + 6 files: the tool
  returns at most 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT_DIR = ROOT / ".gpu_kit"
TOTAL_BUDGET_S = 480  # the 8 minutes; the device tool's command limit is 600 s
TERM_GRACE_S = 10
TAIL_CHARS = 3000
MAIN_JOB_STEPS = 40
REPORT_JSON, REPORT_TEXT = "gpu_day.json", "gpu_day.txt"

PREFLIGHT = """
import importlib.metadata as md, sys
import megatron.core, hydra, omegaconf, math_verify, torch, transformers
import gspo_megatron.train
image = ["torch", "transformers", "triton", "numpy", "huggingface-hub", "packaging", "pytest", "pytest-timeout"]
for name in image + sys.argv[1:]:  # then the kit's packages
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "absent")
"""
CUDA_CHECK = """
import sys, torch
if not torch.cuda.is_available():
    print(f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none "
          "(torch.cuda.is_available() is False)")
    sys.exit(3)
props = torch.cuda.get_device_properties(0)
print(f"{torch.cuda.device_count()} x {props.name}, compute capability {props.major}.{props.minor}, "
      f"{props.total_memory / 2**30:.1f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}")
"""
NO_CUDA_RC = 3

# What cannot travel, and the tests that skip without it.
NOT_CARRIED = {
    "transformer_engine": (
        "TransformerEngine",
        "its CUDA builds (hundreds of MB, compiled against one torch) do not fit the 64 MiB that travels; "
        "skipped: test_te_spec_equals_portable_spec, test_te_grouped_mlp_equals_sequential_mlp, "
        "tests/gpu/test_precision_aware_gpu.py (megatron's precision-aware optimizer is TE's FusedAdam)",
    ),
    "sglang": (
        "SGLang",
        "sglang[all] (GBs: sgl-kernel, flashinfer) pins its own torch, which would replace the image's; "
        "skipped: tests/gpu/test_sglang_gpu.py",
    ),
}
ONE_GPU_SKIPS = (
    "test_tp2_equals_single_rank, test_alltoall_equals_allgather_on_two_gpus, test_calibrate_on_gpu[2]: need two GPUs"
)


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    box_s: int
    command: list[str]
    stops_the_run: bool  # nothing after it can run when it fails


@dataclasses.dataclass
class StepResult:
    step: str
    command: str
    box_s: int
    rc: int | None  # None: ended by its time box
    seconds: float
    timed_out: bool
    counts: dict[str, int]  # pytest's closing line (passed, failed, skipped, errors, ...); empty for other steps
    tail: str


@dataclasses.dataclass
class Report:
    verdict: str
    exit_status: int
    dry_run: bool
    device: str
    started: str
    seconds: float
    budget_s: int
    steps: list[StepResult]
    not_run: list[dict[str, str]]


def kit_names(kit_dir: Path) -> list[str]:
    """The kit's packages, as its requirements.txt names them (``name==version`` lines)."""
    path = kit_dir / "requirements.txt"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [line.split("==")[0] for line in lines if line.strip()]


def plan_steps(python: str, kit_dir: Path, run_dir: Path) -> list[Step]:
    """The day's steps in order; their boxes sum to at most ``TOTAL_BUDGET_S``."""
    pytest = [python, "-m", "pytest", "-v", "-p", "no:cacheprovider"]  # -v: each test's outcome as it ends
    install = [python, "-m", "pip", "install", "--no-index", "--find-links", str(kit_dir), "--no-compile"]
    train = [python, "-m", "gspo_megatron.train", f"run_dir={run_dir}", "logging.progress=false"]
    return [
        Step("install", 30, [*install, "-r", str(kit_dir / "requirements.txt")], stops_the_run=True),
        Step("preflight", 60, [python, "-c", PREFLIGHT, *kit_names(kit_dir)], stops_the_run=True),
        Step("cuda", 15, [python, "-c", CUDA_CHECK], stops_the_run=True),
        Step("gpu_tier", 225, [*pytest, "tests/gpu", "--ignore=tests/gpu/test_calibrate_gpu.py"], False),
        Step("main_job", 75, [*train, f"trainer.steps={MAIN_JOB_STEPS}"], stops_the_run=False),
        Step("calibrate", 75, [*pytest, "-s", "tests/gpu/test_calibrate_gpu.py"], stops_the_run=False),
    ]


PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")
PYTEST_SUMMARY = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's closing line (``3 passed, 2 skipped in 4.1s``); empty when there is none."""
    summary = next((line for line in reversed(output.splitlines()) if PYTEST_SUMMARY.search(line)), "")
    if not summary:
        return {}
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
    for number, kind in PYTEST_COUNT.findall(summary):
        counts["errors" if kind.startswith("error") else kind] = int(number)
    return counts


def shown(step: Step) -> str:
    """The step's command as the report shows it (an inline script by its step's name)."""
    return " ".join(f"<{step.name} script>" if "\n" in arg else arg for arg in step.command)


def run_step(step: Step, log_path: Path, env: dict[str, str], box_scale: float) -> StepResult:
    """Run one step in its own session under its box (times ``box_scale``), its output to ``log_path``."""
    started, box_s = time.monotonic(), step.box_s * box_scale
    print(f"[gpu-day] {step.name} (box {box_s:.0f} s): {shown(step)}", flush=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            step.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            process.wait(timeout=box_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_session(process)
    output = log_path.read_text(errors="replace")
    rc = None if timed_out else process.returncode
    result = StepResult(
        step.name,
        shown(step),
        round(box_s),
        rc,
        round(time.monotonic() - started, 1),
        timed_out,
        pytest_counts(output),
        output[-TAIL_CHARS:],
    )
    print(f"[gpu-day] {step.name}: rc {rc}{' (box ran out)' if timed_out else ''} in {result.seconds} s", flush=True)
    return result


def stop_session(process: subprocess.Popen) -> None:
    """SIGTERM to the step's whole session, SIGKILL after ``TERM_GRACE_S`` (it started that session)."""
    for signum, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, TERM_GRACE_S)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def missing_packages() -> list[dict[str, str]]:
    """What did not travel and is absent here, and why, with the tests that skip for it."""
    absent = [(what, why) for module, (what, why) in NOT_CARRIED.items() if importlib.util.find_spec(module) is None]
    return [{"what": what, "why": why} for what, why in absent]


def decide(results: list[StepResult], dry_run: bool) -> tuple[str, int]:
    """The verdict and the exit status: a dry run succeeds at its CUDA check whatever it finds there."""
    last = results[-1]
    failed = [r.step for r in results if r.rc != 0 and not (r.step == "cuda" and r.rc == NO_CUDA_RC and dry_run)]
    if dry_run and last.step == "cuda" and not failed:
        return f"dry run: stopped at the CUDA check ({last.tail.strip().splitlines()[-1]})", 0
    if failed:
        return "failed: " + ", ".join(failed), 1
    return "passed: every step", 0


def run_day(python: str, kit_dir: Path, out: Path, dry_run: bool, box_scale: float = 1.0) -> Report:
    started, start = datetime.now(UTC).isoformat(timespec="seconds"), time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env |= {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}  # the lent machine reaches no hub: fail, not hang
    results: list[StepResult] = []
    with tempfile.TemporaryDirectory(prefix="gpu_day_") as scratch:
        for step in plan_steps(python, kit_dir, Path(scratch) / "main_job"):
            result = run_step(step, out / f"{step.name}.log", env, box_scale)
            results.append(result)
            if step.name == "cuda" and (dry_run or result.rc != 0):
                break
            if result.rc != 0 and step.stops_the_run:
                break
    verdict, exit_status = decide(results, dry_run)
    cuda = next((r for r in results if r.step == "cuda"), None)
    device = cuda.tail.strip().splitlines()[-1] if cuda and cuda.tail.strip() else "not checked"
    ran = {r.step for r in results}
    not_run = missing_packages()
    not_run += [
        {"what": s.name, "why": "dry run" if dry_run else "an earlier step failed"}
        for s in plan_steps(python, kit_dir, Path())
        if s.name not in ran
    ]
    if not dry_run and cuda is not None and cuda.rc == 0:
        not_run.append({"what": "two-GPU tests", "why": ONE_GPU_SKIPS})
    seconds = round(time.monotonic() - start, 1)
    budget_s = round(TOTAL_BUDGET_S * box_scale)
    return Report(verdict, exit_status, dry_run, device, started, seconds, budget_s, results, not_run)


def write_reports(report: Report, out: Path) -> None:
    (out / REPORT_JSON).write_text(json.dumps(dataclasses.asdict(report), indent=2) + "\n")
    lines = [f"GPU day {report.started}: {report.verdict}", f"device: {report.device}", ""]
    for r in report.steps:
        counts = ", ".join(f"{n} {k}" for k, n in r.counts.items())
        status = "box ran out" if r.timed_out else f"rc {r.rc}"
        lines.append(f"{r.step:10} {status:12} {r.seconds:6.1f} s of {r.box_s:3d}  {counts}")
    lines += ["", "not run:"] + [f"  {item['what']}: {item['why']}" for item in report.not_run]
    for r in report.steps:
        lines += ["", f"--- {r.step}: {r.command}", r.tail.rstrip()]
    (out / REPORT_TEXT).write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="stop at the CUDA check (exit 0 with or without one)")
    parser.add_argument("--kit", type=Path, default=KIT_DIR, help="the kit's folder (tools/gpu_kit.py build)")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="the reports' folder (default $OUT)")
    parser.add_argument(
        "--box-scale", type=float, default=1.0, help="multiply every time box (a slower machine: this one's test)"
    )
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("no report folder: pass --out DIR or set OUT (the device tool sets it)")
    if not (args.kit / "requirements.txt").is_file():
        parser.error(f"no kit at {args.kit}: build it here first with `python3 tools/gpu_kit.py build`")
    args.out.mkdir(parents=True, exist_ok=True)
    report = run_day(sys.executable, args.kit.resolve(), args.out, args.dry_run, args.box_scale)
    write_reports(report, args.out)
    print((args.out / REPORT_TEXT).read_text().split("\n--- ")[0], flush=True)
    return report.exit_status


if __name__ == "__main__":
    sys.exit(main())
