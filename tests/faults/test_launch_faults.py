"""The documented 2-rank launch (``launch/train_local.sh``) under an operator's eye (issue 34, D2/D7/D16).

Each test starts the real script in its own session with a marker in its environment, so every
process of the run (ranks and whatever they start) is found through /proc while it runs and after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.policy.checkpoint.store import latest_checkpoint, read_trainer_state
from gspo_megatron.testing.processes import (
    describe,
    eventually,
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
WORKER_REWARD = (
    "task.reward=import:gspo_megatron.rollout.rewards.builtin:exact_match"  # reward workers: helpers to stop
)


def _launch(overrides: list[str], run_dir: Path) -> tuple[subprocess.Popen, str]:
    """The script in a session of its own (its group is what a terminal's Ctrl-C reaches); output in
    ``run_dir.parent / "launch.log"``."""
    env, marker = marked_env()
    env.update(NPROC="2", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    command = ["bash", str(REPO / "launch" / "train_local.sh"), f"run_dir={run_dir}", *overrides]
    with open(_log(run_dir), "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
    return process, marker


def _log(run_dir: Path) -> Path:
    return run_dir.parent / "launch.log"


def _running_step(run_dir: Path, process: subprocess.Popen, steps: int = 1):
    def reached() -> bool:
        assert process.poll() is None, f"the run ended early: {_log(run_dir).read_text()[-3000:]}"
        return len(read_metrics(run_dir)) >= steps

    return reached


def _rank_process(launcher: subprocess.Popen, marker: str, rank: int) -> int:
    """The rank's own process: a child of the launcher with ``RANK=rank``."""
    for pid in run_processes(marker):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent == launcher.pid and f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} among the run's processes:\n{describe(run_processes(marker))}")


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


def test_a_stopped_rank_is_named_within_the_timeout(tmp_path):
    """SIGSTOP rank 1 mid-run: rank 0's collective times out after parallel.timeout_s and the error
    names rank 1 and where it was (was: 640 s of silence, gloo's hard-coded 600 s)."""
    run_dir, timeout_s = tmp_path / "run", 10  # a tiny step's collectives take well under a second
    process, marker = _launch(TWO_RANKS + ["trainer.steps=500", f"parallel.timeout_s={timeout_s}"], run_dir)
    try:
        wait_until(_running_step(run_dir, process), timeout=600, what="the first step")
        os.kill(_rank_process(process, marker, 1), signal.SIGSTOP)
        named = eventually(lambda: "silent: rank 1 (last seen in step" in _log(run_dir).read_text(), timeout_s + 60)
        assert named, (
            f"rank 0 did not name the stopped rank 1 within {timeout_s + 60} s:\n{_log(run_dir).read_text()[-4000:]}"
        )
        report = [line for line in _log(run_dir).read_text().splitlines() if "silent: rank 1" in line]
    finally:
        _stop(process, marker)
    assert "rank 0: a collective failed in step" in report[0] and f"parallel.timeout_s={timeout_s}" in report[0]


@pytest.mark.parametrize(
    "how",
    ["ctrl-c to the group", "ctrl-c to the group, again", "sigterm to the launcher"],
)
def test_two_rank_signal_saves_and_exits_128_plus_signal(tmp_path, how):
    """Ctrl-C reaches a terminal's whole foreground group (launcher and, under torchrun, every helper);
    a scheduler's SIGTERM reaches the launcher. Either way every rank saves, the exit status is 130/143
    (torchrun: 1), and nothing of the run is left (torchrun lost the save in 2 of 4 Ctrl-C trials)."""
    run_dir = tmp_path / "run"
    signum = signal.SIGTERM if how.startswith("sigterm") else signal.SIGINT
    overrides = TWO_RANKS + ["trainer.steps=500", "checkpoint.save_every=1000", WORKER_REWARD]
    process, marker = _launch(overrides, run_dir)
    try:
        wait_until(_running_step(run_dir, process), timeout=600, what="the first step")
        if signum == signal.SIGINT:
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=600)
        eventually(lambda: not run_processes(marker), timeout=60)
        left = run_processes(marker)
    finally:
        _stop(process, marker)
    log = _log(run_dir).read_text()
    assert code == 128 + signum, log[-3000:]
    steps = [m["step"] for m in read_metrics(run_dir)]
    latest = latest_checkpoint(run_dir)
    assert latest is not None and read_trainer_state(latest)["step"] == steps[-1], log[-3000:]
    assert f"stopped by {signal.Signals(signum).name} after step {steps[-1]}" in log
    assert not left, f"left running after the run stopped:\n{describe(left)}"


def test_a_killed_rank_ends_the_job_and_leaves_no_process(tmp_path):
    """SIGKILL of rank 1: the launcher stops rank 0, exits 128 + 9, and no process of the run is left
    (rank 1's helpers go with it through its reaper)."""
    run_dir = tmp_path / "run"
    process, marker = _launch(TWO_RANKS + ["trainer.steps=500", WORKER_REWARD], run_dir)
    try:
        wait_until(_running_step(run_dir, process), timeout=600, what="the first step")
        os.kill(_rank_process(process, marker, 1), signal.SIGKILL)
        code = process.wait(timeout=120)
        eventually(lambda: not run_processes(marker), timeout=60)
        left = run_processes(marker)
    finally:
        _stop(process, marker)
    assert code == 128 + signal.SIGKILL, _log(run_dir).read_text()[-3000:]
    assert not left, f"left running after rank 1 was killed:\n{describe(left)}"


@pytest.mark.parametrize("address, warned", [("0.0.0.0", True), ("127.0.0.1", False)])
def test_a_single_node_store_beyond_loopback_is_announced(tmp_path, address, warned):
    """issue 43: ``--master-addr 0.0.0.0`` on one node listened on every interface without a word."""
    script = tmp_path / "rank.py"
    script.write_text("import os; print('rank', os.environ['RANK'])\n")
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "gspo_megatron.launcher", "--nproc-per-node", "1", "--master-addr", address]
    done = subprocess.run([*command, "--script", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "rank 0" in done.stdout, done.stderr[-2000:]
    notice = f"one node, but the rendezvous store will listen on {address}, which other machines can reach"
    assert (notice in done.stderr) == warned, done.stderr
