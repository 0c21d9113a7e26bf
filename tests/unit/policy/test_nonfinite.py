"""NonFiniteGuard: detection of loss and gradient values, the skip/stop policy and the streak limit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.policy.nonfinite import NonFiniteError, NonFiniteGuard, parameters_finite


def _ddp(*grads):
    return SimpleNamespace(buffers=[SimpleNamespace(grad_data=g) for g in grads], expert_parallel_buffers=[])


def test_check_names_what_is_not_finite():
    guard = NonFiniteGuard()
    fine = _ddp(torch.ones(4))
    assert guard.check([torch.tensor(1.0)], fine) is None
    assert guard.check([torch.tensor(float("nan"))], fine) == "loss non-finite"
    assert (
        guard.check([torch.tensor(1.0)], _ddp(torch.ones(3), torch.tensor([1.0, float("inf")])))
        == "gradients non-finite"
    )
    assert (
        guard.check([torch.tensor(float("inf"))], _ddp(torch.tensor([float("nan")]))) == "loss and gradients non-finite"
    )


def test_skip_counts_and_stops_after_the_streak():
    guard = NonFiniteGuard("skip", max_consecutive=3)
    guard.record("loss non-finite", "step 1 update 0")
    guard.record(None, "step 1 update 1")  # a clean update ends the streak
    guard.record("loss non-finite", "step 2 update 0")
    guard.record("loss non-finite", "step 2 update 1")
    assert guard.step_metrics() == {"nonfinite/skipped_updates": 3.0, "nonfinite/consecutive": 2.0}
    assert guard.step_metrics()["nonfinite/skipped_updates"] == 0.0
    with pytest.raises(NonFiniteError, match="3 consecutive updates skipped"):
        guard.record("gradients non-finite", "step 3 update 0")


def test_stop_policy_stops_at_the_first():
    with pytest.raises(NonFiniteError, match="step 1 update 0: loss non-finite.*on_nonfinite=stop"):
        NonFiniteGuard("stop").record("loss non-finite", "step 1 update 0")


def test_optimizer_reports_are_findings():
    assert NonFiniteGuard.after_step(True, 1.5) is None
    assert NonFiniteGuard.after_step(True, None) is None
    assert "skipped" in NonFiniteGuard.after_step(False, None)
    assert "inf" in NonFiniteGuard.after_step(True, float("inf"))


def test_parameters_finite():
    layer = torch.nn.Linear(2, 2)
    assert parameters_finite(layer)
    with torch.no_grad():
        layer.weight[0, 0] = float("nan")
    assert not parameters_finite(layer)
