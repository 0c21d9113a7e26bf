import pytest
import torch

from gspo_megatron.rollout.shaping import DAPOOverlongConfig, KimiLengthConfig, ShapingGroup
from gspo_megatron.rollout.shaping.length import dapo_overlong, dapo_overlong_penalty, kimi_length, kimi_length_reward
from gspo_megatron.rollout.shaping.segmentation import step_counts

TRIGGERS = ["Wait", "Alternatively"]  # shaping.trigger_words


def make_group(lengths, correct, rewards, max_response_length=10):
    size = len(lengths)
    return ShapingGroup(
        rewards=torch.tensor(rewards),
        correct=torch.tensor(correct),
        format_ok=torch.ones(size, dtype=torch.bool),
        response_texts=[""] * size,
        steps=step_counts([""] * size, TRIGGERS),
        response_lengths=torch.tensor(lengths),
        max_response_length=max_response_length,
    )


def test_dapo_penalty_zones():
    # L_max = 10, L_cache = 4: free up to 6, then (6 - L)/4, -1 beyond 10.
    penalty = dapo_overlong_penalty(torch.tensor([0, 5, 6, 7, 8, 10, 12]), 10, 4)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))


def test_dapo_is_added_and_max_length_defaults_to_the_group():
    group = make_group([4, 8, 10], [True, True, False], [1.0, 1.0, 0.0], max_response_length=10)
    out = dapo_overlong(group, DAPOOverlongConfig(cache_length=4))
    torch.testing.assert_close(out.rewards, torch.tensor([1.0, 0.5, -1.0]))
    assert out.metrics["penalized_fraction"].item() == pytest.approx(2 / 3)
    explicit = dapo_overlong(group, DAPOOverlongConfig(max_length=12, cache_length=4))
    torch.testing.assert_close(explicit.rewards, torch.tensor([1.0, 1.0, -0.5]))  # free up to 8


def test_dapo_cache_longer_than_generation_is_a_clear_error():
    group = make_group([4], [True], [1.0], max_response_length=10)
    with pytest.raises(ValueError, match="cache_length"):
        dapo_overlong(group, DAPOOverlongConfig())  # default cache 4096 > 10
    with pytest.raises(ValueError, match="max_length"):
        DAPOOverlongConfig(max_length=100, cache_length=200)


def test_kimi_length_reward_by_hand():
    # min 10, max 30: lambda = [0.5, 0, -0.5]
    lengths = torch.tensor([10, 20, 30])
    torch.testing.assert_close(
        kimi_length_reward(lengths, torch.tensor([True, False, True])), torch.tensor([0.5, 0.0, -0.5])
    )
    # Incorrect responses get min(0, lambda): never a bonus for being short.
    torch.testing.assert_close(
        kimi_length_reward(lengths, torch.tensor([False, True, False])), torch.tensor([0.0, 0.0, -0.5])
    )
    torch.testing.assert_close(
        kimi_length_reward(torch.tensor([10, 15, 30]), torch.ones(3, dtype=torch.bool)),
        torch.tensor([0.5, 0.25, -0.5]),
    )


def test_kimi_equal_lengths_and_single_sample_give_zero():
    all_correct = torch.ones(3, dtype=torch.bool)
    torch.testing.assert_close(kimi_length_reward(torch.tensor([7, 7, 7]), all_correct), torch.zeros(3))
    one_incorrect = torch.zeros(1, dtype=torch.bool)
    torch.testing.assert_close(kimi_length_reward(torch.tensor([7]), one_incorrect), torch.zeros(1))


def test_kimi_weight_scales_the_added_reward():
    group = make_group([10, 20, 30], [True, False, True], [1.0, 0.0, 1.0])
    out = kimi_length(group, KimiLengthConfig(weight=0.2))
    torch.testing.assert_close(out.rewards, torch.tensor([1.1, 0.0, 0.9]))
    with pytest.raises(ValueError, match="weight"):
        KimiLengthConfig(weight=-1.0)
