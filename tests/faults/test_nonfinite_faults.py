"""A training run that blows up (lr 1e20: NaN from step 2) stops with a diagnosis and keeps a good checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.policy.checkpoint.store import latest_checkpoint
from gspo_megatron.testing.train_runs import FAST, checkpoint_tensors, read_metrics, run_training

pytestmark = [pytest.mark.faults, pytest.mark.e2e]


def test_exploding_run_skips_then_stops_and_keeps_a_finite_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    overrides = FAST + [
        "trainer.steps=4",
        "optimizer.lr=1e20",
        "optimizer.warmup_steps=0",
        "optimizer.decay_style=constant",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=1",
        "trainer.max_consecutive_nonfinite=2",
        "routing.enabled=false",
        "reward.in_process=true",
        # rewards that vary within every group: a gradient from step 1 on
        "task.reward=import:gspo_megatron.testing.reward_doubles:varied_by_response",
    ]
    done = run_training(overrides, run_dir)
    assert done.returncode != 0, "a run whose loss is NaN must not exit 0"
    assert "consecutive updates skipped" in done.stderr and "non-finite" in done.stderr
    latest = latest_checkpoint(run_dir)
    assert latest is not None
    tensors = checkpoint_tensors(latest, tmp_path)
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert not bad, f"the latest checkpoint holds non-finite tensors: {bad[:5]}"
    metrics = read_metrics(run_dir)
    assert metrics and metrics[-1]["step"] == int(latest.name.split("_")[-1])
    # every logged step either updated with a finite loss or counted its skipped updates
    for m in metrics:
        assert math.isfinite(m["loss/policy"]) or m["nonfinite/skipped_updates"] > 0
