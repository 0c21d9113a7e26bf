"""Entropy bonus and reference KL: estimator values, gradients and aggregation, by hand."""

import math

import pytest
import torch

from gspo_megatron.algorithms.config import KLConfig
from gspo_megatron.algorithms.kl import reference_kl
from gspo_megatron.algorithms.losses import LossConfig, LossContext
from gspo_megatron.algorithms.metrics import finalize_metrics
from gspo_megatron.algorithms.regularizers import entropy_bonus, kl_penalty

LN2 = math.log(2.0)


@pytest.mark.parametrize(
    "estimator, value, grad",
    [
        ("k1", LN2, 1.0),
        ("k2", 0.5 * LN2**2, LN2),
        ("k3", 0.5 - 1 + LN2, 0.5),
        ("low_var_kl", 0.5 - 1 + LN2, 0.5),  # inside its bounds low_var_kl is k3
    ],  # d = ln 2: exp(-d) = 1/2
)
def test_estimators_value_and_gradient_at_ln2(estimator, value, grad):
    log_probs = torch.tensor([[LN2 - 1.0]], requires_grad=True)
    kl = reference_kl(log_probs, torch.tensor([[-1.0]]), estimator)
    kl.sum().backward()
    assert kl.item() == pytest.approx(value, rel=1e-6)
    assert log_probs.grad.item() == pytest.approx(grad, rel=1e-6)


def test_estimators_vanish_when_policy_equals_reference_and_clamp_stops_overflow():
    log_probs = torch.tensor([[-0.3, -2.0]])
    for name in ("k1", "k2", "k3"):
        assert torch.all(reference_kl(log_probs, log_probs.clone(), name) == 0)
    huge = reference_kl(torch.tensor([[-1.0]]), torch.tensor([[-1e4]]), "k3", clamp=20.0)
    assert torch.isfinite(huge).all() and huge.item() == pytest.approx(math.exp(-20) - 1 + 20)


@pytest.mark.parametrize(
    "d, value, grad",
    [
        (-2.0, math.exp(2) - 3, 1 - math.exp(2)),  # k3 = e^2 - 1 - 2 = 4.389 < 10: unbounded, k3's gradient
        (-3.0, 10.0, 0.0),  # k3 = e^3 - 4 = 16.09 > 10: verl's bound, no gradient
        (-20.0, 10.0, 0.0),  # k3 here would be e^20 - 21 = 4.85e8 with gradient -4.85e8
        (12.0, 10.0, 0.0),  # k3 = e^-12 + 11 = 11.000006 > 10
        (10.0, math.exp(-10) + 9, 1 - math.exp(-10)),
    ],
)
def test_low_var_kl_is_verls_clamped_k3(d, value, grad):
    """verl-project/verl verl/trainer/ppo/core_algos.py kl_penalty_forward, "low_var_kl":
    kl = clamp(ref - logp, -20, 20); kld = exp(kl) - kl - 1; return clamp(kld, -10, 10)."""
    log_probs = torch.tensor([[d - 1.0]], dtype=torch.float64, requires_grad=True)
    kl = reference_kl(log_probs, torch.tensor([[-1.0]], dtype=torch.float64), "low_var_kl", clamp=20.0)
    kl.sum().backward()
    assert kl.item() == pytest.approx(value, rel=1e-9)
    assert log_probs.grad.item() == pytest.approx(grad, rel=1e-9, abs=1e-12)
    unclamped = reference_kl(log_probs.detach(), torch.tensor([[-1.0]], dtype=torch.float64), "k3", clamp=20.0)
    assert unclamped.item() == pytest.approx(math.exp(-d) - 1 + d, rel=1e-9)  # k3 keeps TRL's unbounded form


def test_kl_penalty_sequence_mean_of_token_means_by_hand():
    # row 0: d = [ln2, 0] on 2 valid tokens; row 1: d = [ln2] on 1 valid token (second masked, d huge there)
    ref = torch.tensor([[-1.0, -1.0], [-1.0, -50.0]])
    log_probs = (ref + torch.tensor([[LN2, 0.0], [LN2, 40.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    ctx = LossContext(
        LossConfig(name="grpo", clip_low=0.2, clip_high=0.2), global_num_sequences=4
    )  # two more rows elsewhere
    term, metrics = kl_penalty(log_probs, ref, mask, ctx, coef=0.1, estimator="k1")
    # (1/4) * (mean(ln2, 0) + ln2) * 0.1
    assert term.item() == pytest.approx(0.1 * (LN2 / 2 + LN2) / 4, rel=1e-6)
    assert finalize_metrics(metrics)["kl_ref"].item() == pytest.approx(2 * LN2 / 3, rel=1e-6)
    term.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.1 / 8, 0.1 / 8], [0.1 / 4, 0.0]]))
    with pytest.raises(ValueError, match="no ref_log_probs"):
        kl_penalty(log_probs, None, mask, ctx, coef=0.1, estimator="k1")


def test_entropy_bonus_token_mean_by_hand():
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ctx = LossContext(
        LossConfig(name="grpo", clip_low=0.2, clip_high=0.2, aggregation="token_mean"), global_num_tokens=6
    )
    term = entropy_bonus(entropy, mask, ctx, coef=0.01)
    assert term.item() == pytest.approx(-0.01 * 6 / 6)
    term.backward()
    torch.testing.assert_close(entropy.grad, -0.01 / 6 * mask)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: KLConfig(coef=-0.1), "algorithm.kl.coef must be >= 0"),
        (lambda: KLConfig(coef=0.1, estimator="k4"), "algorithm.kl.estimator='k4' is unknown; valid: k1, k2, k3"),
        (lambda: KLConfig(reference="."), "algorithm.kl.coef=0 never uses it"),
        (
            lambda: KLConfig(coef=0.1, reference="/no/such/checkpoint"),
            "algorithm.kl.reference='/no/such/checkpoint' is not a",
        ),
        (lambda: LossConfig(entropy_coef=float("nan")), "algorithm.loss.entropy_coef must be finite"),
    ],
)
def test_config_errors_name_the_key(build, match):
    with pytest.raises(ValueError, match=match):
        build()
