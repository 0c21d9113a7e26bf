"""Shaping in all-correct groups: std normalisation erases lambda; the two literature fixes keep it."""

import pytest
import torch

from gspo_megatron.algorithms.advantages import AdvantageContext, group_relative
from gspo_megatron.shaping import GRSPConfig, ShapingConfig, ShapingGroup
from gspo_megatron.shaping.combine import shaped_advantages
from gspo_megatron.shaping.grsp import grsp

# Confidence segments (window 1, threshold -1, edge 3): 2 short | 1 long | 1 short + 1 long, whose
# per-cluster z-scores are Z (hand-computed in test_shaping_grsp.py).
LOG_PROBS = [
    torch.tensor([-0.1, -0.1, -2.0, -0.1]),
    torch.tensor([-0.1, -0.1, -0.1]),
    torch.tensor([-0.1, -2.0, -0.1, -0.1, -0.1]),
]
Z = torch.tensor([[1.22474487, -1.41421356], [-1.22474487, 0.70710678], [0.0, 0.70710678]])
PENALTY = Z @ torch.tensor([2 / 3, 1 / 3])  # default descending weights over 2 clusters


def make_group(correct, rewards=None):
    return ShapingGroup(
        rewards=torch.tensor(rewards if rewards is not None else [1.0] * 3),
        correct=torch.tensor(correct),
        format_ok=torch.ones(3, dtype=torch.bool),
        response_texts=[""] * 3,
        response_lengths=torch.tensor([4, 3, 5]),
        max_response_length=8,
        token_log_probs=LOG_PROBS,
    )


def confidence_cfg(**overrides):
    return GRSPConfig(
        segmentation="confidence", confidence_window=1, confidence_threshold=-1.0, bucket_edges=[3.0], **overrides
    )


def advantages(rewards, shaped, combine="reward", normalize_std=True):
    context = AdvantageContext(group_size=3, normalize_std=normalize_std)
    return shaped_advantages(rewards, shaped, lambda r: group_relative(r, context), 3, combine).advantages


def shaped_rewards(group, coef):
    return grsp(group, confidence_cfg(penalty_coef=coef)).rewards


@pytest.mark.parametrize("coef", [0.001, 0.1, 1.0])
def test_all_correct_group_std_normalisation_erases_lambda(coef):
    """The documented interaction (combine=reward, normalize_std=true): every lambda, one advantage."""
    group = make_group([True, True, True])
    shaped = shaped_rewards(group, coef)
    expected = -(PENALTY - PENALTY.mean()) / (PENALTY.std() + 1e-6 / coef)
    torch.testing.assert_close(advantages(group.rewards, shaped), expected, atol=1e-4, rtol=1e-4)


def test_all_correct_group_lambda_scales_the_advantage_after_normalisation_or_without_std():
    group = make_group([True, True, True])
    for coef in (0.001, 0.1, 1.0):
        shaped = shaped_rewards(group, coef)
        expected = -coef * (PENALTY - PENALTY.mean())  # A_i = d_i - mean d, d = -lambda P
        torch.testing.assert_close(advantages(group.rewards, shaped, "advantage"), expected)
        torch.testing.assert_close(advantages(group.rewards, shaped, normalize_std=False), expected)


def test_mixed_group_after_normalisation_keeps_the_correctness_signal_at_unit_scale():
    group = make_group([True, False, True], rewards=[1.0, 0.0, 1.0])
    shaped = shaped_rewards(group, 0.1)
    raw = group_relative(group.rewards, AdvantageContext(group_size=3)).advantages
    delta = shaped - group.rewards
    torch.testing.assert_close(advantages(group.rewards, shaped, "advantage"), raw + delta - delta.mean())
    assert not torch.allclose(delta, torch.zeros(3))  # the two correct responses are re-ranked


def test_combine_is_validated():
    with pytest.raises(ValueError, match="shaping.combine"):
        ShapingConfig(combine="after")
    assert ShapingConfig(name="grsp", grsp=GRSPConfig(), combine="advantage").combine == "advantage"
