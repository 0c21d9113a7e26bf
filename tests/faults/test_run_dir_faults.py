"""Fault injection on run-directory ownership and resume: nothing a previous or concurrent run wrote is lost.

One real 2-step run (module fixture, with a second run started into its directory while it runs)
provides a run directory; each test copies it and points another real training process at it.
Refusals happen before the model is built, so they cost a process start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gspo_megatron.policy.checkpoint.store import checkpoint_run_id, latest_checkpoint
from gspo_megatron.run.run_dir_owner import LOCK_FILE
from gspo_megatron.testing.train_runs import FAST, read_metrics, run_training, train_command

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

BASE = FAST + ["checkpoint.save_every=1", "checkpoint.keep_last=1"]


@dataclass
class FinishedRun:
    run_dir: Path
    first: subprocess.CompletedProcess
    second: subprocess.CompletedProcess  # started into the same run_dir while the first was running
    first_pid: int


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> FinishedRun:
    """A 2-step run, and a second run started into its run_dir while it ran (two runs, one run_dir)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    first = subprocess.Popen(
        train_command(BASE, run_dir), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / LOCK_FILE).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        second = run_training(BASE, run_dir)
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    return FinishedRun(run_dir, subprocess.CompletedProcess(first.args, first.returncode, out, err), second, first.pid)


def test_two_runs_into_one_run_dir(finished_run):
    """The second run is refused while the first runs; the first finishes with everything intact."""
    run_dir = finished_run.run_dir
    assert finished_run.second.returncode != 0
    assert f"in use by pid {finished_run.first_pid}" in finished_run.second.stderr
    assert finished_run.first.returncode == 0, finished_run.first.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
    latest = latest_checkpoint(run_dir)
    assert latest.name == "step_000002" and not list((run_dir / "checkpoints").glob("*.partial"))
    assert torch.load(latest / "trainer_state.pt", weights_only=True)["step"] == 2
    assert not (run_dir / LOCK_FILE).exists()


def _copy(run_dir, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run_dir.run_dir, target)
    return target


def _snapshot(run_dir) -> dict:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_fresh_run_into_a_used_run_dir_is_refused_and_touches_nothing(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    before = _snapshot(run_dir)
    done = run_training(BASE, run_dir)
    assert done.returncode != 0
    assert "already holds a run" in done.stderr and "checkpoint.overwrite=true" in done.stderr
    assert _snapshot(run_dir) == before


def test_overwrite_prunes_only_its_own_checkpoints(finished_run, tmp_path):
    """The previous run's newest checkpoint sorts after the new run's: it must not evict them."""
    run_dir = _copy(finished_run, tmp_path)
    root = run_dir / "checkpoints"
    os.replace(root / "step_000002", root / "step_000010")  # the old run got further than the new one will
    (root / "latest").write_text("step_000010")
    done = run_training(BASE + ["checkpoint.overwrite=true"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    latest = latest_checkpoint(run_dir)
    assert latest is not None and latest.name == "step_000002"
    assert (root / "step_000010").is_dir(), "the previous run's checkpoint was pruned by the new run"
    assert checkpoint_run_id(root / "step_000010") != checkpoint_run_id(latest)
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]


def test_resume_true_with_nothing_to_resume_is_an_error(tmp_path):
    done = run_training(BASE + ["checkpoint.resume=true"], tmp_path / "typo")
    assert done.returncode != 0 and "holds no checkpoint" in done.stderr
    assert not (tmp_path / "typo" / "metrics.jsonl").exists()


def test_resume_with_a_changed_algorithm_is_refused_with_the_keys(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    before = _snapshot(run_dir)
    done = run_training(BASE + ["checkpoint.resume=true", "algorithm=grpo", "optimizer.lr=0.1"], run_dir)
    assert done.returncode != 0
    assert "algorithm.name: 'gspo' -> 'grpo'" in done.stderr and "optimizer.lr: 0.001 -> 0.1" in done.stderr
    assert _snapshot(run_dir) == before  # config.yaml included: nothing is written before the load


def test_resume_with_allowed_change_continues(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    refused = run_training(BASE + ["checkpoint.resume=true", "trainer.steps=3"], run_dir)
    assert refused.returncode != 0 and "trainer.steps: 2 -> 3" in refused.stderr
    done = run_training(
        BASE + ["checkpoint.resume=auto", "trainer.steps=3", "checkpoint.resume_allow_changes=[trainer.steps]"], run_dir
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert "steps: 3" in (run_dir / "config.yaml").read_text()
    assert not (run_dir / LOCK_FILE).exists()


def test_overwrite_keeps_another_runs_checkpoint_of_the_same_step(finished_run, tmp_path):
    """D9: the new run's step_000002 collides with the old run's; the old one used to be deleted."""
    run_dir = _copy(finished_run, tmp_path)
    root = run_dir / "checkpoints"
    old_id = checkpoint_run_id(root / "step_000002")
    old_state = (root / "step_000002" / "trainer_state.pt").read_bytes()
    done = run_training(BASE + ["checkpoint.overwrite=true"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    kept = root / f"step_000002.run_{old_id}"
    assert kept.is_dir(), f"the previous run's step_000002 was deleted: {sorted(p.name for p in root.iterdir())}"
    assert checkpoint_run_id(kept) == old_id and (kept / "trainer_state.pt").read_bytes() == old_state
    latest = latest_checkpoint(run_dir)
    assert latest is not None and latest.name == "step_000002" and checkpoint_run_id(latest) not in ("", old_id)
    assert f"step_000002 of another run moved to {kept}" in done.stdout


def _poison_weight(model_optim: Path, key: str) -> None:
    """Overwrite one saved tensor of a torch distributed checkpoint with NaN, in place: what a bit
    flip or a bad copy does (the same number of bytes, so every index into the file still holds)."""
    import io
    import pickle

    with open(model_optim / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # the checkpoint the fixture's own run wrote
    ((_, info),) = [(index, info) for index, info in metadata.storage_data.items() if index.fqn == key]
    shard = model_optim / info.relative_path
    blob = shard.read_bytes()
    segment = blob[info.offset : info.offset + info.length]
    out = io.BytesIO()
    torch.save(torch.full_like(torch.load(io.BytesIO(segment), weights_only=True), float("nan")), out)
    assert len(out.getvalue()) == len(segment)
    shard.write_bytes(blob[: info.offset] + out.getvalue() + blob[info.offset + info.length :])


@pytest.mark.parametrize(
    "key, named",
    [
        ("output_layer.weight", "holds non-finite (NaN/inf) weights"),
        # issue 43: NaN in Adam's state trained one step, then was blamed on training
        ("optimizer.state.exp_avg.output_layer.weight", "holds non-finite (NaN/inf) optimizer state: exp_avg of "),
    ],
    ids=["weight", "exp_avg"],
)
def test_nan_in_a_checkpoint_is_refused_when_loaded(finished_run, tmp_path, key, named):
    """D21: a poisoned checkpoint was trained on and found only at the next save ('the parameters
    hold non-finite values'), blamed on training; now the load names the checkpoint (and the tensor)."""
    run_dir = _copy(finished_run, tmp_path)
    checkpoint = run_dir / "checkpoints" / "step_000002"
    _poison_weight(checkpoint / "model_optim", key)
    before = [m["step"] for m in read_metrics(run_dir)]
    done = run_training(
        BASE + ["checkpoint.resume=true", "trainer.steps=3", "checkpoint.resume_allow_changes=[trainer.steps]"], run_dir
    )
    assert done.returncode != 0
    assert f"checkpoint {checkpoint} {named}" in done.stderr, done.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == before  # nothing trained on it
    assert latest_checkpoint(run_dir) == checkpoint


def test_resume_on_a_read_only_mount_names_the_run_dir_and_the_fix(finished_run, tmp_path):
    """Issue 63 item 7: resuming a run directory on a read-only mount failed with a bare ``OSError:
    [Errno 30]`` on the lock's temporary file. The mount is a real one: a tmpfs in a private mount
    namespace (``unshare -m``) holding a copy of a finished run, remounted read-only; skipped where the
    machine does not allow mounting one."""
    import shlex
    import sys

    device = tmp_path / "device"
    device.mkdir()
    probe = f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(device))}"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "sh", "-c", probe]).returncode != 0:
        pytest.skip("this machine does not allow a tmpfs in a private mount namespace (unshare -m)")
    run_dir = device / "run"
    train = [sys.executable, "-m", "gspo_megatron.train", f"run_dir={run_dir}", *BASE, "checkpoint.resume=true"]
    script = " && ".join(
        [
            f"mount -t tmpfs -o size=64m tmpfs {shlex.quote(str(device))}",
            f"cp -r {shlex.quote(str(finished_run.run_dir))} {shlex.quote(str(run_dir))}",
            f"mount -o remount,ro {shlex.quote(str(device))}",
            shlex.join(train),
        ]
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    named = f"{run_dir} is not writable (Read-only file system: {run_dir}/{LOCK_FILE}."
    assert named in done.stderr, done.stderr[-3000:]
    assert "remount a read-only one read-write" in done.stderr
