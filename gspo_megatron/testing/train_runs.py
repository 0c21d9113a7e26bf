"""Run the real training entry point in spawned ranks (isolated from the test process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

# what warnings.showwarning prints: "<file>:<line>: <Category>: <message>"
WARNING_LINE = re.compile(r"^\S.*:\d+: (\w*Warning): (.*)$", re.MULTILINE)

# Two short steps of small batches, for any config (an experiment's included); no charts drawn (the
# numbers are all written; the charts cost a tiny run most of its time: tests that check them leave
# SHORT out or add logging.charts=true).
SHORT = [
    "trainer.steps=2",
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.micro_batch_size=4",
    "trainer.eval_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.charts=false",
]
# The tiny model on the one-token task (+experiment=max_digit_one_token, the main job before
# 2026-11-28): the smallest job that exercises every phase. A test's own task=/model=/
# rollout.max_new_tokens= after these wins; with +experiment=, whose values these would override,
# leave them out.
TINY_JOB = ["model=tiny", "task=max_digit", "rollout.max_new_tokens=1"]
# The tests' runs: the tiny job, two short steps.
FAST = [*TINY_JOB, *SHORT]


def without_time(metrics: list[dict]) -> list[dict]:
    """Metrics with the wall-clock ``time/`` keys left out: what two equal runs share exactly."""
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def train_worker(ctx, overrides: list[str], run_dir: str):
    """One rank of a training run; returns the metrics the driver wrote (rank 0) or []."""
    from gspo_megatron.config.compose import compose
    from gspo_megatron.train import run

    run(compose(overrides), run_dir)
    return read_metrics(run_dir) if ctx.rank == 0 else []


def train_command(overrides: list[str], run_dir: str | Path) -> list[str]:
    """The real command line of a training run (``python -m gspo_megatron.train``) into ``run_dir``."""
    import sys

    return [sys.executable, "-m", "gspo_megatron.train", f"run_dir={run_dir}", *overrides]


def run_training(overrides: list[str], run_dir: str | Path, timeout: float = 600, env: dict | None = None):
    """Run training to the end in a child process; returns the ``CompletedProcess`` (text output).
    ``env``: variables set for the child beside this process's (e.g. ``PYTHONPATH``)."""
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    env.pop("WORLD_SIZE", None)
    return subprocess.run(train_command(overrides, run_dir), env=env, capture_output=True, text=True, timeout=timeout)


def checkpoint_tensors(checkpoint: str | Path, scratch: str | Path) -> dict:
    """Every tensor of a trainer checkpoint's ``model_optim`` (read without a process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(scratch) / "checkpoint.pt"
    dcp_to_torch_save(str(Path(checkpoint) / "model_optim"), str(out))
    state = torch.load(out, weights_only=False)  # our own file, written just now
    return {k: v for k, v in state.items() if torch.is_tensor(v)}
