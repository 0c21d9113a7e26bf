"""A verifier that fails in every way, inside a real run: each failure costs one sample, the run goes on."""

from __future__ import annotations

import math

import pytest

from gspo_megatron.rollout.rewards.types import FAILURE_KINDS
from gspo_megatron.testing.train_runs import FAST, read_metrics, run_training

pytestmark = [pytest.mark.faults, pytest.mark.e2e]


def test_misbehaving_verifier_costs_samples_not_the_run(tmp_path):
    run_dir = tmp_path / "run"
    overrides = FAST + [
        "task.reward=import:gspo_megatron.testing.reward_doubles:misbehaves_by_digit",
        "reward.timeout_s=2",
        "reward.startup_timeout_s=120",
        "routing.enabled=false",
    ]
    done = run_training(overrides, run_dir)  # no reward.in_process: the default must isolate an import: reward
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        per_kind = [m[f"reward/errors/{kind}"] for kind in FAILURE_KINDS]
        assert sum(per_kind) == m["reward/errors"]
        assert math.isfinite(m["reward/mean"])  # NaN/inf rewards never reach the batch
    assert sum(m["reward/errors"] for m in metrics) > 0, "the injected failures never happened"
