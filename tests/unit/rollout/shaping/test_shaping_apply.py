import math

import pytest
import torch

from gspo_megatron.contracts.samples import FinishReason, Sample
from gspo_megatron.rollout.shaping import (
    SHAPERS,
    ShapedRewards,
    ShapingConfig,
    ShapingGroup,
    group_from_samples,
    shape_batch,
    shape_group,
)
from gspo_megatron.rollout.shaping.segmentation import step_counts

TRIGGERS = ["Wait", "Alternatively"]  # shaping.trigger_words


def make_group(texts, correct, lengths, rewards=None):
    size = len(texts)
    return ShapingGroup(
        rewards=torch.tensor(rewards if rewards is not None else [float(c) for c in correct]),
        correct=torch.tensor(correct),
        format_ok=torch.ones(size, dtype=torch.bool),
        response_texts=texts,
        steps=step_counts(texts, TRIGGERS),
        response_lengths=torch.tensor(lengths),
        max_response_length=100,
    )


def test_batch_metrics_pool_responses_and_nanmean_scalars():
    groups = [
        make_group(["Wait a", "b"], [True, True], [10, 30]),  # steps [2, 1], mu = 1.5
        make_group(["Wait Wait", "c", "Alternatively d"], [False, False, False], [20, 40, 100]),  # no mu
    ]
    batch = shape_batch(groups, ShapingConfig(name="step_grpo"))
    metrics = batch.metrics
    # Per-response metrics pooled over the 5 responses.
    assert metrics["steps_per_response"].item() == pytest.approx((2 + 1 + 3 + 1 + 2) / 5)
    assert metrics["tokens_per_response"].item() == pytest.approx(200 / 5)
    # Per-group scalars averaged over groups; the group without a correct response is NaN and skipped.
    assert metrics["accuracy"].item() == pytest.approx(0.5)
    assert metrics["step_grpo/correct_steps_mean"].item() == pytest.approx(1.5)
    assert math.isnan(batch.groups[1].metrics["step_grpo/correct_steps_mean"].item())
    # Raw vs shaped: group 0 raw mean 1, shaped 0.9(1 -+ 0.5 tanh(+-1/3)) + 0.1 -> mean 1.0;
    # group 1 raw 0, shaped 0.1 each.
    assert metrics["raw_reward_mean"].item() == pytest.approx(0.5)
    assert metrics["shaped_reward_mean"].item() == pytest.approx((1.0 + 0.1) / 2)
    assert metrics["shaping_delta_mean"].item() == pytest.approx((0.0 + 0.1) / 2)
    # Segments per length cluster (default edges 64, 256), per response: short [1, 1, 2, 1, 0]
    # ("Wait Wait" is two ~10-token segments), medium [0, 0, 0, 0, 1] (one 100-token segment).
    torch.testing.assert_close(metrics["segments_per_cluster"], torch.tensor([1.0, 0.2, 0.0]))


def test_none_shaper_leaves_rewards_and_input_unchanged():
    group = make_group(["a", "b"], [True, False], [1, 2], rewards=[0.7, 0.2])
    batch = shape_batch([group, group], ShapingConfig(name="none"))
    torch.testing.assert_close(batch.rewards(), torch.tensor([[0.7, 0.2], [0.7, 0.2]]))
    batch.groups[0].rewards += 1.0
    torch.testing.assert_close(group.rewards, torch.tensor([0.7, 0.2]))


def test_rewards_stack_needs_equal_group_sizes():
    batch = shape_batch([make_group(["a"], [True], [1]), make_group(["a", "b"], [True, True], [1, 2])], ShapingConfig())
    with pytest.raises(ValueError, match="different sizes"):
        batch.rewards()
    with pytest.raises(ValueError, match="at least one group"):
        shape_batch([], ShapingConfig())


def test_shaper_returning_wrong_shape_is_caught(monkeypatch):
    def broken_shaper(group, cfg):  # a deliberately wrong shaper, registered only for this test
        return ShapedRewards(rewards=group.rewards[:1])

    monkeypatch.setitem(SHAPERS._entries, "broken", broken_shaper)
    with pytest.raises(ValueError, match="returned rewards of shape"):
        shape_group(make_group(["a", "b"], [True, True], [1, 2]), ShapingConfig(name="broken"))


def test_group_from_samples_takes_lengths_and_log_probs():
    samples = [
        Sample(
            prompt_ids=[1],
            output_ids=[5, 6, 7],
            output_log_probs=torch.tensor([-0.1, -2.0, -0.1]),
            finish_reason=FinishReason.STOP,
        ),
        Sample(
            prompt_ids=[1], output_ids=[8], output_log_probs=torch.tensor([-0.3]), finish_reason=FinishReason.LENGTH
        ),
    ]
    group = group_from_samples(
        samples,
        torch.tensor([1.0, 0.0]),
        torch.tensor([True, False]),
        torch.tensor([True, True]),
        ["x Wait z", "w"],
        max_response_length=3,
        trigger_words=TRIGGERS,
    )
    assert group.response_lengths.tolist() == [3, 1]
    assert group.steps.tolist() == [2, 1]  # 1 + the trigger words in each text
    torch.testing.assert_close(group.token_log_probs[0], torch.tensor([-0.1, -2.0, -0.1]))
