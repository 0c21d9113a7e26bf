"""Resume applies the optimizer changes the resume check allowed (issue 34, D3).

Megatron's scheduler used to take lr, min_lr, warmup, decay steps and style from the checkpoint (and
the param groups their max_lr), so ``optimizer.lr=... checkpoint.resume_allow_changes=[optimizer.]``
logged the old schedule, and a longer ``trainer.steps`` did not stretch it.
"""

from __future__ import annotations

import shutil

import pytest

from gspo_megatron.testing.train_runs import FAST, read_metrics, run_training

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

# the default schedule: lr 1e-3 cosine to 1e-4 after 2 warmup updates
BASE = FAST + ["checkpoint.save_every=1", "routing.enabled=false"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two") / "run"
    done = run_training(BASE, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _resume(two_steps, tmp_path, overrides: list[str]):
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    done = run_training(BASE + ["checkpoint.resume=true", *overrides], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, read_metrics(run_dir)


def test_resume_with_an_allowed_lr_change_uses_it(two_steps, tmp_path):
    # constant decay: every update after the change runs at exactly the new lr
    changes = ["optimizer.lr=0.0025", "optimizer.decay_style=constant", "trainer.steps=3"]
    done, metrics = _resume(
        two_steps, tmp_path, changes + ["checkpoint.resume_allow_changes=[optimizer.,trainer.steps]"]
    )
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[2]["lr"] == 0.0025, metrics[2]["lr"]
    assert "resumed from" in done.stdout and "lr 0.0025" in done.stdout, done.stdout[-2000:]
    assert "schedule max_lr 0.001 -> 0.0025 (from the config)" in done.stdout


def test_longer_run_stretches_the_schedule(two_steps, tmp_path):
    """Extended from 2 to 4 steps, steps 3-4 run at the lr of a run planned for 4 steps from the start."""
    _, resumed = _resume(two_steps, tmp_path, ["trainer.steps=4", "checkpoint.resume_allow_changes=[trainer.steps]"])
    planned = run_training(BASE + ["trainer.steps=4"], tmp_path / "planned")
    assert planned.returncode == 0, planned.stderr[-3000:]
    expected = [m["lr"] for m in read_metrics(tmp_path / "planned")][2:]
    assert [m["lr"] for m in resumed][2:] == expected
    assert expected[0] != [m["lr"] for m in resumed][1]  # the schedule moves: the check can fail
