"""Shaping in all-correct groups: std normalisation erases lambda; the two literature fixes keep it."""

import pytest
import torch

from gspo_megatron.algorithms.advantages import AdvantageContext, group_relative
from gspo_megatron.rollout.shaping import GRSPConfig, ShapingConfig, ShapingGroup
from gspo_megatron.rollout.shaping.combine import shaped_advantages
from gspo_megatron.rollout.shaping.grsp import grsp
from gspo_megatron.rollout.shaping.segmentation import step_counts

TRIGGERS = ["Wait", "Alternatively"]  # shaping.trigger_words


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
        steps=step_counts([""] * 3, TRIGGERS),
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


def _step_grpo_advantages(beta: float, combine: str) -> torch.Tensor:
    """An all-correct Step-GRPO group (steps 1, 2, 3, 5, 2) under ``combine``, as the trainer combines."""
    from gspo_megatron.rollout.shaping import StepGRPOConfig
    from gspo_megatron.rollout.shaping.step_grpo import step_grpo

    texts = ["x", "x Wait y", "x Wait y Wait z", "x Wait a Wait b Wait c Wait d", "x Wait y"]
    group = ShapingGroup(
        rewards=torch.ones(5),
        correct=torch.ones(5, dtype=torch.bool),
        format_ok=torch.ones(5, dtype=torch.bool),
        response_texts=texts,
        steps=step_counts(texts, TRIGGERS),
        response_lengths=torch.tensor([1, 3, 5, 9, 3]),
        max_response_length=16,
    )
    shaped = step_grpo(group, StepGRPOConfig(beta=beta)).rewards
    context = AdvantageContext(group_size=5)
    return shaped_advantages(group.rewards, shaped, lambda r: group_relative(r, context), 5, combine).advantages


def test_default_combine_keeps_beta_and_lambda_in_an_all_correct_group():
    """Under the DEFAULT combination the shaping coefficient scales the advantages of an all-correct
    group (under combine=reward beta=0.05 and beta=0.5 give identical advantages)."""
    default = ShapingConfig().combine
    assert default == "advantage"
    small, large = _step_grpo_advantages(0.05, default), _step_grpo_advantages(0.5, default)
    # k = 1,2,3,5,2, mu = 2.6: A_i = -alpha*beta*(tanh((k_i - mu)/mu) - mean tanh), linear in beta
    k = torch.tensor([1.0, 2.0, 3.0, 5.0, 2.0])
    tanh = torch.tanh((k - k.mean()) / k.mean())
    torch.testing.assert_close(large, -0.9 * 0.5 * (tanh - tanh.mean()))
    torch.testing.assert_close(large, 10 * small)
    assert large[0] > large[1] > large[2] > large[3]  # fewer steps, larger advantage
    reward_small, reward_large = _step_grpo_advantages(0.05, "reward"), _step_grpo_advantages(0.5, "reward")
    torch.testing.assert_close(reward_small, reward_large, atol=1e-4, rtol=1e-4)  # the old default: no scale
    group = make_group([True, True, True])
    magnitudes = [advantages(group.rewards, shaped_rewards(group, c), default).abs().sum() for c in (0.01, 0.1, 1.0)]
    assert magnitudes[0] < magnitudes[1] < magnitudes[2]


def test_zero_variance_metric_counts_groups_without_signal_after_combining():
    """combine=advantage: a group with constant task reward but a varying shaping term has signal, and
    is not counted as zero-variance (the metric used to describe the raw rewards)."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    shaped = torch.tensor([0.9, 1.0, 0.8, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # group 3: no shaping variation
    context = AdvantageContext(group_size=3)
    out = shaped_advantages(rewards, shaped, lambda r: group_relative(r, context), 3, "advantage")
    assert float(out.stats["zero_variance_group_frac"]) == pytest.approx(1 / 3)
    assert float(out.stats["advantage_abs_mean"]) == pytest.approx(float(out.advantages.abs().mean()))
    raw_only = shaped_advantages(rewards, rewards, lambda r: group_relative(r, context), 3, "advantage")
    assert float(raw_only.stats["zero_variance_group_frac"]) == pytest.approx(2 / 3)


def test_step_grpo_combined_as_the_paper_does_hand_computed():
    """shaping.combine=reward, Step-GRPO's formulation (study E4's step_grpo_reward arm): R_i REPLACES the reward and
    the group normalises it, A_i = (R_i - mean R) / (std R + eps). Hand-computed: k = 1,2,3,1,2 with the first three
    correct, so mu = (1 + 2 + 3)/3 = 2 and, alpha 0.9, beta 0.5,
        R = 0.9 (1 - 0.5 tanh((k - 2)/2)) + 0.1 = 1.2079527, 1.0, 0.7920473 (correct);  0.1, 0.1 (format only),
    mean R = 3.2/5 = 0.64, sample std (n - 1 = 4) = 0.5144144."""
    from gspo_megatron.rollout.shaping import StepGRPOConfig
    from gspo_megatron.rollout.shaping.step_grpo import step_grpo

    texts = ["x", "x Wait y", "x Wait y Wait z", "x", "x Wait y"]
    group = ShapingGroup(
        rewards=torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]),
        correct=torch.tensor([True, True, True, False, False]),
        format_ok=torch.ones(5, dtype=torch.bool),
        response_texts=texts,
        steps=step_counts(texts, TRIGGERS),
        response_lengths=torch.tensor([1, 3, 5, 1, 3]),
        max_response_length=16,
    )
    shaped = step_grpo(group, StepGRPOConfig()).rewards
    torch.testing.assert_close(shaped, torch.tensor([1.2079527, 1.0, 0.7920473, 0.1, 0.1]))
    context = AdvantageContext(group_size=5)
    got = shaped_advantages(group.rewards, shaped, lambda r: group_relative(r, context), 5, "reward").advantages
    std = 0.5144144
    expected = torch.tensor([0.5679527, 0.36, 0.1520473, -0.54, -0.54]) / (std + 1e-6)
    torch.testing.assert_close(got, expected)
    # the task reward (1, 1, 1, 0, 0) is not what is normalised: the correct responses' advantages differ by steps
    assert got[0] > got[1] > got[2] > 0 > got[3] == got[4]
