"""Sampling primitives of the embedded engine, checked against hand-computed distributions."""

import math

import pytest
import torch

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.embedded.sampling import (
    UNIFORM_BLOCK,
    RowUniforms,
    filter_top_k_top_p,
    row_generators,
    sample_next_tokens,
    sampling_log_probs,
)

PROBS = torch.tensor([0.1, 0.5, 0.15, 0.25])  # sorted: 1 (0.5), 3 (0.25), 2 (0.15), 0 (0.1)
LOGITS = PROBS.log().unsqueeze(0)


def first_uniforms(seed: int, rows: int) -> torch.Tensor:
    return RowUniforms(row_generators(seed, rows)).at(list(range(rows)), 0)


def kept(logits):
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_top_k_and_top_p_keep_the_hand_computed_sets():
    assert kept(filter_top_k_top_p(LOGITS, top_k=2, top_p=1.0)) == [1, 3]
    assert kept(filter_top_k_top_p(LOGITS, top_k=-1, top_p=0.7)) == [1, 3]  # mass above token 2 is 0.75 > 0.7
    assert kept(filter_top_k_top_p(LOGITS, top_k=-1, top_p=0.76)) == [1, 2, 3]  # 0.75 <= 0.76, token 0 has 0.9 above it
    assert kept(filter_top_k_top_p(LOGITS, top_k=-1, top_p=0.3)) == [1]  # the best token is always kept
    # top-p mass is measured before top-k (SGLang): top-k 2 does not make the nucleus smaller
    assert kept(filter_top_k_top_p(LOGITS, top_k=3, top_p=0.76)) == [1, 2, 3]
    assert kept(filter_top_k_top_p(LOGITS, top_k=2, top_p=0.7)) == [1, 3]


def test_log_probs_use_temperature_and_greedy_reports_temperature_one():
    expected = torch.log_softmax(LOGITS / 0.5, -1)
    torch.testing.assert_close(sampling_log_probs(LOGITS, 0.5), expected)
    tokens, log_probs = sample_next_tokens(LOGITS, SamplingParams(temperature=0.0), None)
    assert tokens.tolist() == [1] and log_probs.item() == pytest.approx(math.log(0.5))


def test_reported_log_prob_is_before_filtering():
    params = SamplingParams(temperature=1.0, top_k=1)
    tokens, log_probs = sample_next_tokens(LOGITS, params, first_uniforms(3, 1))
    assert tokens.tolist() == [1] and log_probs.item() == pytest.approx(math.log(0.5))  # not log(1)


def test_sampling_frequencies_follow_the_filtered_distribution():
    rows = 4000
    logits = LOGITS.expand(rows, -1)
    tokens, _ = sample_next_tokens(logits, SamplingParams(temperature=1.0, top_p=0.7), first_uniforms(1, rows))
    counts = torch.bincount(tokens, minlength=4).float() / rows
    # nucleus {1, 3} renormalised: 0.5 / 0.75 and 0.25 / 0.75
    torch.testing.assert_close(counts, torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]), atol=0.03, rtol=0)
    tokens, _ = sample_next_tokens(logits, SamplingParams(temperature=1.0), first_uniforms(2, rows))
    counts = torch.bincount(tokens, minlength=4).float() / rows
    torch.testing.assert_close(counts, PROBS, atol=0.03, rtol=0)


def test_row_generators_are_reproducible_and_distinct():
    first = [torch.rand((), generator=g).item() for g in row_generators(7, 3)]
    again = [torch.rand((), generator=g).item() for g in row_generators(7, 3)]
    assert first == again and len(set(first)) == 3


def test_row_uniforms_are_each_rows_draws_one_per_step():
    """Drawn a block at a time, a row's uniform of step t is still its generator's t-th single draw (the
    per-step draws the engine made before), across block boundaries and for rows that left the batch."""
    steps, rows = 2 * UNIFORM_BLOCK + 3, 5
    expected = [[torch.rand((), generator=g).item() for _ in range(steps)] for g in row_generators(11, rows)]
    uniforms = RowUniforms(row_generators(11, rows))
    active = list(range(rows))
    for step in range(steps):
        if step == UNIFORM_BLOCK - 1:
            active = [0, 2, 4]  # rows leave the batch; the others' draws are unchanged
        assert uniforms.at(active, step).tolist() == [expected[r][step] for r in active]
    with pytest.raises(ValueError, match="uniforms"):
        sample_next_tokens(LOGITS, SamplingParams(temperature=1.0), None)
