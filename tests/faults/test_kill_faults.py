"""SIGTERM mid-run and SIGKILL mid-save on real training processes: nothing written so far is lost."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gspo_megatron.policy.checkpoint.store import latest_checkpoint, read_trainer_state
from gspo_megatron.run.run_dir_owner import LOCK_FILE
from gspo_megatron.testing.processes import describe, eventually, marked_env, run_processes
from gspo_megatron.testing.train_runs import FAST, checkpoint_tensors, read_metrics, run_training, train_command

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

# an import: reward runs in worker processes: the run has helpers to stop
WORKER_REWARD = "task.reward=import:gspo_megatron.rollout.rewards.builtin:exact_match"


def _start(overrides, run_dir) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen(
        train_command(overrides, run_dir), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(condition, process: subprocess.Popen, timeout: float = 600, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended early: {process.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(poll)


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _sigterm_after_first_step(overrides, run_dir) -> tuple[subprocess.Popen, set[int], str]:
    """Start a run and SIGTERM it once its first step is logged: (the finished process, the processes it
    had started just before the signal, its stderr)."""
    run = _start(overrides, run_dir)
    try:
        _wait_for(lambda: len(read_metrics(run_dir)) >= 1, run)
        helpers = _descendants(run.pid)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return run, helpers, err


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_sigterm_mid_run_saves_stops_helpers_and_exits_nonzero(tmp_path):
    run_dir = tmp_path / "run"
    run, helpers, err = _sigterm_after_first_step(
        FAST + ["trainer.steps=20", WORKER_REWARD, "routing.enabled=false"], run_dir
    )
    assert helpers, "the reward workers should be running"
    assert run.returncode == 128 + signal.SIGTERM, err[-3000:]
    reason = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(reason) == 1 and "continue with checkpoint.resume=true" in reason[0]
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 20
    latest = latest_checkpoint(run_dir)
    assert latest is not None and read_trainer_state(latest)["step"] == steps[-1]
    assert not list((run_dir / "checkpoints").glob("*.partial")) and not (run_dir / LOCK_FILE).exists()
    # the helpers are reaped as the run ends; wait for that event (bounded), not a fixed second
    assert eventually(lambda: not [pid for pid in helpers if _running(pid)], 30), "helper processes outlived the run"


def test_sigkill_during_a_save_then_resume(tmp_path):
    """Killed at a random moment of a checkpoint write: ``latest`` stays complete, resume finishes the run.

    The run has far more steps than fit in the random delay (steps with a save take ~0.5 s; 8 are left
    when the delay starts), so the kill lands mid-run; the test asserts that it did rather than
    assuming it.
    """
    run_dir = tmp_path / "run"
    steps = 10
    overrides = FAST + [f"trainer.steps={steps}", "checkpoint.save_every=1", "checkpoint.keep_last=2"]
    overrides += ["routing.enabled=false"]
    run = _start(overrides, run_dir)
    try:
        _wait_for(lambda: any((run_dir / "checkpoints").glob("step_000002.partial")), run, poll=0.01)
        time.sleep(random.Random(os.getpid()).uniform(0.0, 0.3))
        assert run.poll() is None, "the run finished before the kill: the test no longer kills it mid-save"
        run.kill()
        run.wait()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == -signal.SIGKILL
    latest = latest_checkpoint(run_dir)
    assert latest is not None
    saved = read_trainer_state(latest)["step"]
    assert 1 <= saved < steps and latest.name == f"step_{saved:06d}"
    assert checkpoint_tensors(latest, tmp_path)  # readable, complete
    done = run_training(overrides + ["checkpoint.resume=auto"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, steps + 1))
    assert latest_checkpoint(run_dir).name == f"step_{steps:06d}"


def test_sigterm_without_save_on_signal_names_the_checkpoint_the_step_saved(tmp_path):
    """D18: with checkpoint.save_on_signal=false the stop said 'no checkpoint written' although the
    step's scheduled save (save_every=1) had just written one."""
    run_dir = tmp_path / "run"
    overrides = ["trainer.steps=20", "checkpoint.save_every=1", "checkpoint.save_on_signal=false"]
    run, _, err = _sigterm_after_first_step(FAST + overrides + ["routing.enabled=false"], run_dir)
    assert run.returncode == 128 + signal.SIGTERM, err[-3000:]
    (reason,) = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    latest = latest_checkpoint(run_dir)
    assert latest is not None and read_trainer_state(latest)["step"] == len(read_metrics(run_dir))
    assert f"checkpoint {latest}; continue with checkpoint.resume=true" in reason, reason


@pytest.mark.parametrize("phase", ["save", "reward", "idle"])
def test_sigkill_of_the_trainer_leaves_no_process_of_the_run(tmp_path, phase):
    """SIGKILL the trainer while it writes a checkpoint (megatron's writer manager and shard writers
    running), while reward workers compute, and between steps: every process it started is gone within
    a bounded wait (found by an environment marker, since orphans are re-parented)."""
    run_dir = tmp_path / "run"
    started = tmp_path / "reward_started"
    env, marker = marked_env(dict(os.environ, OMP_NUM_THREADS="1", GSPO_TEST_REWARD_STARTED=str(started)))
    env.pop("WORLD_SIZE", None)
    reward = "task.reward=import:gspo_megatron.testing.reward_doubles:announces_and_hangs"
    overrides = FAST + ["trainer.steps=200", "checkpoint.save_every=1", "routing.enabled=false"]
    overrides += [reward, "reward.timeout_s=3000"] if phase == "reward" else [WORKER_REWARD]
    run = subprocess.Popen(
        train_command(overrides, run_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        moment = {
            "save": lambda: any((run_dir / "checkpoints").glob("step_000002.partial/model_optim/*.distcp")),
            "reward": started.exists,
            "idle": lambda: len(read_metrics(run_dir)) >= 2,
        }[phase]
        _wait_for(moment, run, poll=0.005)
        helpers = [pid for pid in run_processes(marker) if pid != run.pid]
        run.kill()
        run.wait()
        assert helpers, "the run had started no helper process: the test would prove nothing"
        eventually(lambda: not run_processes(marker), timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        left = run_processes(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"left running after the trainer was killed ({phase}):\n{describe(left)}"


DETACHED_REWARD = "task.reward=import:gspo_megatron.testing.reward_doubles:starts_a_detached_service"


@pytest.mark.parametrize("end", ["normal", "sigkill"])
def test_a_service_the_user_detached_outlives_the_run_and_nothing_else_does(tmp_path, end):
    """issue 43, N7: every process inheriting the run's tag was killed at the end, so a service a verifier
    started with ``setsid nohup`` died with a normal run ("stopped 3 process(es)"). Now the reaper stops
    only the trainer's own processes: the detached service survives a normal end and a SIGKILL, while
    nothing else of the run is left; a normal run leaves nothing for the reaper to stop."""
    run_dir, pid_file = tmp_path / "run", tmp_path / "service.pid"
    env, marker = marked_env(dict(os.environ, OMP_NUM_THREADS="1", GSPO_TEST_SERVICE_PID=str(pid_file)))
    env.pop("WORLD_SIZE", None)
    steps = "trainer.steps=2" if end == "normal" else "trainer.steps=200"
    overrides = FAST + [steps, "routing.enabled=false", DETACHED_REWARD]
    run = subprocess.Popen(
        train_command(overrides, run_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    service = None
    try:
        _wait_for(pid_file.exists, run, poll=0.01)
        service = int(pid_file.read_text())
        if end == "sigkill":
            _wait_for(lambda: len(read_metrics(run_dir)) >= 1, run)
            run.kill()
        _, err = run.communicate(timeout=600)
        assert end == "sigkill" or run.returncode == 0, err[-3000:]
        eventually(lambda: run_processes(marker) == [service], timeout=60)
        assert _running(service), "the detached service was killed with the run"
        if end == "normal":
            assert "reaper:" not in err, err[-2000:]  # the trainer stopped its helpers itself
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        left = run_processes(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert left == [service], f"left running besides the detached service:\n{describe(left)}"
