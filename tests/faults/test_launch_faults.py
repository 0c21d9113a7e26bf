"""The documented 2-rank launch (``launch/train_local.sh``) under an operator's eye (issue 34, D2/D7/D16).

Each test starts the real script in its own session with a marker in its environment, so every
process of the run (ranks and whatever they start) is found through /proc while it runs and after.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from gspo_megatron.testing.processes import (
    describe,
    is_loopback,
    listeners_of,
    marked_env,
    run_processes,
    wait_until,
)
from gspo_megatron.testing.train_runs import FAST, read_metrics

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
TWO_RANKS = FAST + ["parallel=tp2", "routing.enabled=false"]


def _launch(overrides: list[str], run_dir: Path) -> tuple[subprocess.Popen, str]:
    env, marker = marked_env()
    env.update(NPROC="2", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    command = ["bash", str(REPO / "launch" / "train_local.sh"), f"run_dir={run_dir}", *overrides]
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    return process, marker


def _running_step(run_dir: Path, process: subprocess.Popen, steps: int = 1):
    def reached() -> bool:
        assert process.poll() is None, f"the run ended early: {process.stderr.read()[-3000:]}"
        return len(read_metrics(run_dir)) >= steps

    return reached


def _stop(process: subprocess.Popen, marker: str) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for pid in run_processes(marker):
        os.kill(pid, signal.SIGKILL)


def test_two_rank_launch_listens_on_loopback_only(tmp_path):
    run_dir = tmp_path / "run"
    process, marker = _launch(TWO_RANKS + ["trainer.steps=200"], run_dir)
    try:
        wait_until(_running_step(run_dir, process), timeout=600, what="the first step")
        processes = run_processes(marker)
        listening = listeners_of(processes)
    finally:
        _stop(process, marker)
    assert len(processes) >= 3, describe(processes)  # the launcher and two ranks at least
    assert listening, "found no listening socket at all: the check is not looking at the run"
    exposed = sorted(s for s in listening if not is_loopback(s[1]))
    assert not exposed, f"listening beyond loopback (pid, address, port): {exposed}\n{describe(processes)}"
