"""torchrun's elastic restarts resume a run (issue 48): 2 ranks, ``--max-restarts 2``, two SIGKILLs.

A rank is SIGKILLed once the run's step-2 checkpoint is complete, and, in the restarted group, a
helper process of a rank (the checkpoint writer's result queue) once the step-4 one is. Each time
torchrun's agent stops the other rank and starts both again; they form their process groups in a
store of the new attempt's own (``policy/parallel/attempt_store.py``: torchrun's store still holds the dead
attempt's addresses), resume from the latest complete checkpoint and finish every step, with every
metric equal to an uninterrupted run's. Each restart is bounded: the collective timeout stays at its
default (600 s) and the restarted ranks must have resumed within ``RESTART_BOUND_S`` of the kill.
Every rank's output is as quiet as rank 0's: no unreviewed warning from either (``core/known_warnings.py``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_megatron.policy.checkpoint.store import latest_checkpoint
from gspo_megatron.testing.processes import children, kill_run_processes, marked_env, wait_until
from gspo_megatron.testing.train_runs import FAST, WARNING_LINE, read_metrics, without_time

pytestmark = [pytest.mark.faults, pytest.mark.distributed]

# 40 steps in the LR schedule, 5 run; the entropy bonus gives every step a gradient; a checkpoint a step
BASE = FAST + ["trainer.steps=40", "trainer.stop_after_steps=6", "checkpoint.save_every=1", "routing.enabled=false"]
BASE += ["algorithm.loss.entropy_coef=0.01", "optimizer.warmup_steps=0", "checkpoint.resume=auto"]
RESTART_BOUND_S = 120  # kill -> the restarted ranks resumed; the collective timeout is 600 s
RESUMED = re.compile(r"\[gspo\] resumed from \S+ at step (\d+)")


class TorchrunJob:
    """``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` of the trainer, output to a file."""

    def __init__(self, run_dir: Path, log: Path, max_restarts: int = 1):
        self.run_dir, self.log = run_dir, log
        env, self.marker = marked_env(dict(os.environ, OMP_NUM_THREADS="1"))
        env.pop("WORLD_SIZE", None)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        command += ["--max-restarts", str(max_restarts), "-m", "gspo_megatron.train", f"run_dir={run_dir}", *BASE]
        with log.open("w") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def worker(self, rank: int) -> int:
        """The pid of the rank's process (torchrun's child whose environment has RANK=rank)."""
        for pid in children(self.process.pid):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return pid
        raise AssertionError(f"no rank {rank} among torchrun's children: {children(self.process.pid)}")

    def wait_for(self, condition, what: str, timeout: float = 600) -> None:
        def met() -> bool:
            assert self.process.poll() is None, f"torchrun ended before {what}: {self.output()[-4000:]}"
            return condition()

        wait_until(met, timeout, what)

    def finish(self, timeout: float = 600) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            kill_run_processes(self.marker)


def _checkpointed(run_dir: Path, step: int):
    def done() -> bool:
        latest = latest_checkpoint(run_dir)
        return latest is not None and int(latest.name.split("_")[1]) >= step

    return done


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    job = TorchrunJob(root / "run", root / "torchrun.log")
    assert job.finish() == 0, job.output()[-4000:]
    return read_metrics(root / "run"), job.output()


def test_every_rank_is_as_quiet_as_rank_0(uninterrupted):
    metrics, output = uninterrupted
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert WARNING_LINE.findall(output) == [], output[-4000:]


def _rank_1(job: TorchrunJob) -> int:
    return job.worker(1)


def _helper_of_rank_1(job: TorchrunJob) -> int:
    """A process rank 1 started whose loss fails the rank: the checkpoint writer's result queue (a
    forked multiprocessing manager, so it runs the trainer's command line); not the reaper."""
    rank = job.worker(1)
    helpers = [pid for pid, command in children(rank).items() if "gspo_megatron.run.reaper" not in command]
    assert len(helpers) == 1, children(rank)
    return helpers[0]


def _resumes(job: TorchrunJob) -> list[int]:
    return [int(step) for step in RESUMED.findall(job.output())]


def _kill_then_wait_for_the_restart(job: TorchrunJob, victim, after_step: int) -> float:
    """SIGKILL ``victim`` once the step-``after_step`` checkpoint is complete; seconds until the
    restarted ranks resumed (bounded by ``RESTART_BOUND_S``)."""
    job.wait_for(_checkpointed(job.run_dir, after_step), f"the step-{after_step} checkpoint")
    restarts = len(_resumes(job))
    os.kill(victim(job), signal.SIGKILL)
    killed_at = time.monotonic()
    job.wait_for(lambda: len(_resumes(job)) > restarts, "the restarted ranks to resume", RESTART_BOUND_S)
    return time.monotonic() - killed_at


def test_sigkill_of_a_rank_then_of_a_helper_is_recovered_by_torchrun_restarts(tmp_path, uninterrupted):
    """One run, two restarts (``--max-restarts 2``): rank 1 killed after the step-2 checkpoint, then,
    in the restarted group, rank 1's helper after the step-4 one."""
    job = TorchrunJob(tmp_path / "run", tmp_path / "torchrun.log", max_restarts=2)
    restart_s = [_kill_then_wait_for_the_restart(job, _rank_1, 2)]
    restart_s.append(_kill_then_wait_for_the_restart(job, _helper_of_rank_1, max(4, _resumes(job)[-1] + 1)))
    print(f"kill -> resumed: {restart_s[0]:.1f} s (rank), {restart_s[1]:.1f} s (helper)")
    assert job.finish() == 0, job.output()[-4000:]

    output = job.output()
    assert len(_resumes(job)) == 2 and _resumes(job)[0] >= 2, output[-4000:]
    assert "Connection refused" not in output, output[-4000:]
    expected, _ = uninterrupted  # every step: before the kills, and after each exact resume
    assert without_time(read_metrics(job.run_dir)) == without_time(expected), restart_s
