"""The two Dynamic Truncated Rollout choices (rollout.truncation.train_on_exit_tokens,
shaping.step_grpo.count_dropped_trigger), the token-id trigger check and GRSP's visible penalty."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from gspo_megatron.config.compose import compose
from gspo_megatron.config.store import register_configs
from gspo_megatron.config.validate import ConfigError, validate_config
from gspo_megatron.contracts.samples import Sample, Truncation
from gspo_megatron.rollout.pack import pack_samples
from gspo_megatron.rollout.shaping import GRSPConfig, ShapingGroup, StepGRPOConfig
from gspo_megatron.rollout.shaping.grsp import grsp
from gspo_megatron.rollout.shaping.segmentation import step_counts
from gspo_megatron.rollout.shaping.step_grpo import step_grpo
from gspo_megatron.rollout.shaping.triggers import check_trigger_token_ids
from gspo_megatron.rollout.shaping.types import group_from_samples

TRIGGERS = ["Wait", "Alternatively"]  # shaping.trigger_words


register_configs()


def _dtr_sample(exit_reason: str, forced: list[bool]) -> Sample:
    n = len(forced)
    return Sample(
        prompt_ids=[1, 2],
        output_ids=list(range(10, 10 + n)),
        output_log_probs=torch.tensor([0.0 if f else -0.5 for f in forced]),
        finish_reason="stop",
        truncation=Truncation(exit_reason, 1, [], torch.tensor(forced)),
    )


def test_exit_tokens_trained_on_only_when_configured_and_never_compared_with_the_engine():
    # response: 2 sampled thinking tokens, 2 inserted closing tokens, 1 sampled answer token
    samples = [_dtr_sample("confident", [False, False, True, True, False])]
    zeros = torch.zeros(1)
    masked = pack_samples(samples, zeros, zeros, zeros, 0)
    trained = pack_samples(samples, zeros, zeros, zeros, 0, train_on_exit_tokens=True)
    # targets 1..5 score the response tokens; targets 3, 4 are the inserted ones
    assert masked.response_mask.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert trained.response_mask.tolist() == [[0, 1, 1, 1, 1, 1]]
    for batch in (masked, trained):  # engine/trainer comparisons skip the inserted tokens either way
        assert batch.mismatch_mask.tolist() == [[0, 1, 1, 0, 0, 1]]


def test_train_on_exit_tokens_refuses_engine_log_probs_for_them():
    base = ["task=reasoning_max_digit", "rollout.max_new_tokens=24", "rollout.truncated=true"]
    ok = OmegaConf.to_object(compose(base + ["rollout.truncation.train_on_exit_tokens=true"]))
    validate_config(ok, 1)
    for bad in ("trainer.old_log_probs=rollout", "algorithm.mismatch.correction=sequence_truncate"):
        typed = OmegaConf.to_object(compose(base + ["rollout.truncation.train_on_exit_tokens=true", bad]))
        with pytest.raises(ConfigError, match="train_on_exit_tokens=true.*old_log_probs=trainer"):
            validate_config(typed, 1)


def _group(texts: list[str], dropped: list[int]) -> ShapingGroup:
    n = len(texts)
    return ShapingGroup(
        rewards=torch.ones(n),
        correct=torch.ones(n, dtype=torch.bool),
        format_ok=torch.ones(n, dtype=torch.bool),
        response_texts=texts,
        steps=step_counts(texts, TRIGGERS),
        response_lengths=torch.full((n,), 4),
        max_response_length=8,
        dropped_triggers=torch.tensor(dropped),
    )


def test_steps_before_a_truncation_counted_as_configured():
    # a confident exit at the first trigger (text: one step), one at the second, and a natural end
    group = _group(["a", "a Wait b", "a Wait b"], dropped=[1, 1, 0])
    text_only = step_grpo(group, StepGRPOConfig()).metrics["steps"]
    with_dropped = step_grpo(group, StepGRPOConfig(count_dropped_trigger=True)).metrics["steps"]
    assert text_only.tolist() == [1.0, 2.0, 2.0]
    assert with_dropped.tolist() == [2.0, 3.0, 2.0]


def test_dropped_triggers_come_from_the_samples_exit_reasons():
    samples = [_dtr_sample(reason, [False, True]) for reason in ("confident", "natural_end", "think_budget")]
    group = group_from_samples(
        samples, torch.ones(3), torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool), ["a"] * 3, 8, TRIGGERS
    )
    assert group.dropped_triggers.tolist() == [1, 0, 0]
    plain = [Sample(prompt_ids=[1], output_ids=[2], output_log_probs=torch.zeros(1), finish_reason="stop")]
    assert (
        group_from_samples(
            plain, torch.ones(1), torch.ones(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool), ["a"], 8, TRIGGERS
        ).dropped_triggers
        is None
    )


def test_trigger_token_ids_must_be_trigger_words():
    vocab = {4: "0", 5: " Wait", 6: "x"}
    decode = lambda ids: "".join(vocab[i] for i in ids)
    check_trigger_token_ids([5], ["Wait"], decode)
    with pytest.raises(ValueError, match=r"rollout.truncation.trigger_token_ids.*4 -> '0'.*6 -> 'x'"):
        check_trigger_token_ids([4, 5, 6], ["Wait"], decode)


def test_grsp_logs_a_penalty_that_acts():
    """The mean penalty is 0 by construction; |penalty| and its correlation with segment counts show it."""
    texts = ["a Wait b Wait c Wait d", "a Wait b", "a"]  # 4, 2 and 1 keyword segments, all short
    group = ShapingGroup(
        rewards=torch.ones(3),
        correct=torch.ones(3, dtype=torch.bool),
        format_ok=torch.ones(3, dtype=torch.bool),
        response_texts=texts,
        steps=step_counts(texts, TRIGGERS),
        response_lengths=torch.tensor([7, 3, 1]),
        max_response_length=8,
    )
    metrics = grsp(group, GRSPConfig(keywords=["Wait"], bucket_edges=[64.0])).metrics
    counts = torch.tensor([4.0, 2.0, 1.0])
    z = (counts - counts.mean()) / counts.std(unbiased=False)
    expected_penalty = z * (2 / 3)  # descending weights over 2 clusters: 2/3, 1/3; cluster 1 is empty
    torch.testing.assert_close(metrics["penalty"], expected_penalty)
    assert abs(float(metrics["penalty"].mean())) < 1e-6
    torch.testing.assert_close(metrics["abs_penalty"], expected_penalty.abs())
    assert float(metrics["abs_penalty"].mean()) > 0.5
    corr = metrics["penalty_count_corr"]
    assert corr.shape == (1, 2)
    assert float(corr[0, 0]) == pytest.approx(1.0)  # more short segments, larger penalty
    assert math.isnan(float(corr[0, 1]))  # no long segments: undefined
