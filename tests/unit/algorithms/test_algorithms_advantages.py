"""Group-relative advantages: hand-computed values, zero-variance groups, stats, errors."""

import math

import pytest
import torch

from gspo_megatron.algorithms import ADVANTAGE_ESTIMATORS, AdvantageContext


def test_group_relative_hand_computed_with_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # two groups of 3
    out = ADVANTAGE_ESTIMATORS.get("group_relative")(rewards, AdvantageContext(group_size=3, eps=0.0))
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0]: sqrt((4/9 + 1/9 + 1/9) / 2)
    expected = [(2 / 3) / std, -(1 / 3) / std, -(1 / 3) / std, 0.0, 0.0, 0.0]  # zero-variance group -> 0
    torch.testing.assert_close(out.advantages, torch.tensor(expected))
    torch.testing.assert_close(out.stats["zero_variance_group_frac"], torch.tensor(0.5))
    torch.testing.assert_close(out.stats["reward_mean"], torch.tensor(4 / 6))
    torch.testing.assert_close(out.stats["reward_std"], torch.tensor(math.sqrt((4 / 3) / 5)))


def test_group_relative_without_std_is_mean_centred():
    rewards = torch.tensor([3.0, 1.0, 0.0, 4.0])
    out = ADVANTAGE_ESTIMATORS.get("group_relative")(rewards, AdvantageContext(group_size=2, normalize_std=False))
    torch.testing.assert_close(out.advantages, torch.tensor([1.0, -1.0, -2.0, 2.0]))
    assert out.stats["zero_variance_group_frac"] == 0


def test_eps_enters_the_denominator():
    rewards = torch.tensor([1.0, 0.0])
    out = ADVANTAGE_ESTIMATORS.get("group_relative")(rewards, AdvantageContext(group_size=2, eps=0.5))
    std = math.sqrt(0.5)
    torch.testing.assert_close(out.advantages, torch.tensor([0.5 / (std + 0.5), -0.5 / (std + 0.5)]))


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        ADVANTAGE_ESTIMATORS.get("group_relative")(torch.zeros(6), AdvantageContext(group_size=4))
    with pytest.raises(ValueError, match="normalize_std needs group_size >= 2"):
        AdvantageContext(group_size=1)
    with pytest.raises(ValueError, match="flat"):
        ADVANTAGE_ESTIMATORS.get("group_relative")(torch.zeros(2, 2), AdvantageContext(group_size=2))
