"""The distributed optimizer's sharded state through the dist checkpoint, on 2 gloo ranks.

A 2-rank run (torchrun, as the launcher runs it), in fp32 and in bf16, is SIGKILLed right after its
step-2 checkpoint is complete; resumed, it reproduces every metric of an uninterrupted run. The same checkpoint resumes
on one rank with the distributed optimizer (megatron reshards its state over the new data-parallel
size); a resume whose ``optimizer.distributed`` resolves to the other optimizer is refused before
anything is loaded, naming the fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from gspo_megatron.policy.checkpoint.store import DISTRIBUTED_KEY, latest_checkpoint, read_trainer_state
from gspo_megatron.testing.distributed import DistributedRunError, run_distributed
from gspo_megatron.testing.processes import kill_run_processes, marked_env, wait_until
from gspo_megatron.testing.train_runs import FAST, train_worker, without_time

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.faults]

# 40 steps in the LR schedule, 6 run: the killed run is far from its end when the kill lands; the
# entropy bonus gives every step a gradient (the tiny task's rewards are often all equal in a group)
BASE = FAST + ["trainer.steps=40", "trainer.stop_after_steps=6", "checkpoint.save_every=2", "routing.enabled=false"]
BASE += ["algorithm.loss.entropy_coef=0.01", "optimizer.warmup_steps=0"]
DISTRIBUTED = BASE + ["optimizer.distributed=true"]


def _start_two_ranks(overrides: list[str], run_dir) -> tuple[subprocess.Popen, str]:
    env, marker = marked_env(dict(os.environ, OMP_NUM_THREADS="1"))
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "gspo_megatron.train", f"run_dir={run_dir}", *overrides]
    # marked: the kill finds torchrun, the two ranks it started and their helpers, nothing else
    run = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    return run, marker


def _kill_after_first_checkpoint(started: tuple[subprocess.Popen, str], run_dir, timeout: float = 600) -> None:
    """SIGKILL the whole run (torchrun, the ranks -- each in a session of its own, which torchrun's
    group kill does not reach -- and their helpers) once its first checkpoint is complete, as a lost node
    would; return when none of its processes lives."""
    run, marker = started
    pointer = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    try:
        while not pointer.is_file():
            assert run.poll() is None, f"the run ended before its first checkpoint: {run.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "timed out waiting for the first checkpoint"
            time.sleep(0.02)
    finally:
        wait_until(lambda: not kill_run_processes(marker), 60, "the run's processes to die")
        run.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    metrics = run_distributed(train_worker, 2, DISTRIBUTED, str(run_dir), timeout=900)[0]  # rank 0's
    return run_dir, metrics


@pytest.fixture(scope="module")
def uninterrupted_bf16(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full_bf16")
    metrics = run_distributed(train_worker, 2, DISTRIBUTED + ["model.dtype=bfloat16"], str(run_dir), timeout=900)[0]
    return run_dir, metrics


# Every Adam step count is the checkpoint's after the load (policy/optimizer.py restore_adam_steps): before,
# megatron's load left one shared step tensor holding 0, and the first optimizer step after a resume
# already differed (found when this test's kill began to reach the ranks).
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sigkill_then_resume_continues_exactly(request, tmp_path, dtype):
    """bf16: bf16 weights with fp32 main weights, sharded Adam state and gradient buffers (the cluster's setting)."""
    _, full = request.getfixturevalue("uninterrupted" if dtype == "float32" else "uninterrupted_bf16")
    overrides = DISTRIBUTED + [f"model.dtype={dtype}"]
    run_dir = tmp_path / "killed"
    _kill_after_first_checkpoint(_start_two_ranks(overrides, run_dir), run_dir)
    saved = latest_checkpoint(run_dir)
    state = read_trainer_state(saved)
    assert state[DISTRIBUTED_KEY] is True and 2 <= state["step"] < 6
    resumed = run_distributed(train_worker, 2, overrides + ["checkpoint.resume=true"], str(run_dir), timeout=900)[0]
    assert len(full) == len(resumed) == 6
    assert all(m["grad_norm"] > 0 for m in full)
    assert without_time(resumed) == without_time(full)


def test_resume_on_another_data_parallel_size(uninterrupted, tmp_path):
    """dp 2 -> 1 from the step-4 checkpoint: with the distributed optimizer the run continues (step 5,
    whose gradient depends only on the restored weights, repeats the 2-rank run's to the rounding of
    another reduction order; that the resharded Adam state is exact is checked in
    ``tests/distributed/test_distributed_optimizer.py``); auto (= the plain optimizer on one rank) is
    refused before anything is loaded."""
    full_dir, full = uninterrupted
    run_dir = tmp_path / "one_rank"
    shutil.copytree(full_dir, run_dir)
    (run_dir / "checkpoints" / "latest").write_text("step_000004")
    with pytest.raises(DistributedRunError) as refused:
        run_distributed(train_worker, 1, BASE + ["checkpoint.resume=true"], str(run_dir), timeout=900)
    message = str(refused.value)
    assert "written with optimizer.distributed=true" in message and "resume with optimizer.distributed=true" in message
    (metrics,) = run_distributed(train_worker, 1, DISTRIBUTED + ["checkpoint.resume=true"], str(run_dir), timeout=900)
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert full[4]["grad_norm"] > 0
    for key in ("loss/policy", "grad_norm", "reward/mean", "lr"):
        assert metrics[4][key] == pytest.approx(full[4][key], rel=1e-4, abs=1e-6), key
    assert metrics[5]["lr"] == full[5]["lr"] and metrics[5]["grad_norm"] > 0
