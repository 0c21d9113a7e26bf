"""Token-budget micro-batches: the plan by hand, and partition() cutting the real batch by it."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.contracts.batch import partition
from gspo_megatron.contracts.samples import Sample
from gspo_megatron.contracts.share import step_totals
from gspo_megatron.contracts.token_budget import step_padded_fraction, token_budget_plan
from gspo_megatron.rollout.pack import pack_samples


def test_plan_by_hand():
    # sorted longest first: rows 0(10) 4(9) | 2(7) 5(4) | 1(3) 3(2); stripes of dp=2 rows
    lengths = torch.tensor([10, 3, 7, 2, 9, 4])
    plans = token_budget_plan(lengths, first_row=100, dp_size=2, budget=16)
    # 2 stripes at width 10 would feed 2 * 9 = 18 > 16 tokens; at width 7: 2 * 6 = 12 <= 16
    assert [p.width for p in plans] == [10, 7]
    assert plans[0].rows.tolist() == [[100], [104]]
    assert plans[1].rows.tolist() == [[102, 101], [105, 103]]


def test_plan_rounds_the_fed_length_and_keeps_over_budget_rows_alone():
    plans = token_budget_plan(torch.tensor([9, 6, 5, 2]), first_row=0, dp_size=1, budget=4, multiple=4, max_width=10)
    # fed lengths 8, 5, 4, 1 -> rounded 8, 8, 4, 4 (capped at the batch width 10 -> fed 9)
    assert [(p.rows.tolist(), p.width) for p in plans] == [([[0]], 9), ([[1]], 9), ([[2]], 5), ([[3]], 5)]
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        token_budget_plan(torch.tensor([3, 4]), first_row=0, dp_size=1, budget=0)


def _batch(lengths: list[int], prompt: int = 2) -> RolloutBatch:  # noqa: F821
    samples = [
        Sample(
            prompt_ids=list(range(1, prompt + 1)),
            output_ids=[5 + (i + j) % 7 for j in range(n)],
            output_log_probs=-torch.rand(n),
            finish_reason="stop",
        )
        for i, n in enumerate(lengths)
    ]
    n = len(samples)
    return pack_samples(samples, torch.randn(n), torch.rand(n), torch.rand(n), pad_token_id=0)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_partition_with_budget_covers_every_row_once_cut_to_its_own_longest_row(dp_size):
    lengths = [1, 30, 2, 3, 2, 28, 1, 4]  # long-tailed responses
    batch = _batch(lengths)
    seen = []
    same_index: dict[tuple[int, int], list] = {}  # (update, micro-batch) -> (rows, width) per rank
    for rank in range(dp_size):
        minibatches = partition(
            batch, updates=2, micro_batch_size=4, dp_size=dp_size, dp_rank=rank, micro_batch_tokens=12
        )
        for update, minibatch in enumerate(minibatches):
            for j, mb in enumerate(minibatch):
                rows = mb.rows
                # stays in its mini-batch
                assert all(update * 4 <= r < (update + 1) * 4 for r in rows.tolist())
                width = mb.tokens.shape[1]
                same_index.setdefault((update, j), []).append((rows, tuple(mb.tokens.shape)))
                assert mb.tokens.shape[0] * width <= 12 or mb.tokens.shape[0] == 1
                torch.testing.assert_close(mb.targets, batch.tokens[rows, 1 : width + 1])
                torch.testing.assert_close(mb.response_mask, batch.response_mask[rows, :width])
                torch.testing.assert_close(mb.advantages, batch.advantages[rows])
                # nothing real was cut off
                assert batch.response_mask[rows, width:].sum() == 0
                seen += rows.tolist()
    assert sorted(seen) == list(range(len(lengths)))
    lengths_all = batch.prompt_lengths + batch.response_lengths
    for entries in same_index.values():
        # one shape on every rank
        assert len(entries) == dp_size and len({shape for _, shape in entries}) == 1
        longest = max(int(lengths_all[rows].max()) for rows, _ in entries)
        assert entries[0][1][1] == longest - 1  # padded only to the micro-batch's longest row


def test_fed_shape_counts_rows_tokens_and_micro_batches_of_all_ranks():
    from gspo_megatron.contracts.token_budget import step_fed_shape

    batch = _batch([1, 30, 2, 3, 2, 28, 1, 4])
    plain = step_fed_shape(partition(batch, updates=2, micro_batch_size=2, dp_size=1, dp_rank=0), 1)
    # by hand: 8 rows, each fed at the batch width 31, in 2 micro-batches per update
    assert (plain.rows, plain.tokens, plain.micro_batches_per_rank) == (8, 8 * 31, 4)
    # two data-parallel ranks feed the same shapes: this rank's counts x 2
    half = step_fed_shape(partition(batch, updates=2, micro_batch_size=2, dp_size=2, dp_rank=0), 2)
    assert (half.rows, half.tokens, half.micro_batches_per_rank) == (8, 8 * 31, 2)
    assert plain.metrics()["batch/fed_tokens"] == 248.0


def test_budget_cuts_the_padded_fraction():
    batch = _batch([1, 30, 2, 3, 2, 28, 1, 4])
    padded = step_padded_fraction(
        float(batch.input_mask.sum()), partition(batch, updates=2, micro_batch_size=4, dp_size=1, dp_rank=0), 1
    )
    budgeted = step_padded_fraction(
        float(batch.input_mask.sum()),
        partition(batch, updates=2, micro_batch_size=4, dp_size=1, dp_rank=0, micro_batch_tokens=32),
        1,
    )
    assert 0 <= budgeted < padded < 1
    # by hand: real inputs = sum(prompt + response - 1) = 8 + 71 = 79 of 8 * 31 = 248 fed without a budget
    assert padded == pytest.approx(1 - 79 / 248)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_mismatch_correction_follows_the_rows_and_width_of_budget_micro_batches(mode):
    """correct_mismatch weighs each micro-batch's rows (any rows, cut to their own width) exactly as
    the whole batch is weighed: per-token weights are cut to the micro-batch's width."""
    from gspo_megatron.algorithms.config import AlgorithmConfig, MismatchConfig
    from gspo_megatron.algorithms.losses import LossConfig
    from gspo_megatron.algorithms.mismatch_correction import mismatch_weights, weighted_advantages
    from gspo_megatron.loop.corrections import correct_mismatch

    batch = _batch([1, 30, 2, 3, 2, 28, 1, 4])
    old_log_probs = batch.rollout_log_probs + 0.3 * torch.randn_like(batch.rollout_log_probs)
    algorithm = AlgorithmConfig(loss=LossConfig(name="grpo"), mismatch=MismatchConfig(correction=mode, cap=1.5))
    minibatches = partition(batch, updates=2, micro_batch_size=4, dp_size=1, dp_rank=0, micro_batch_tokens=12)
    totals = step_totals(batch, 2)
    given = [[mb.advantages for mb in minibatch] for minibatch in minibatches]
    result = correct_mismatch(batch, old_log_probs, minibatches, algorithm, totals)
    assert result.totals is totals  # algorithm.mismatch.rejected=keep: the denominators stand
    assert [
        [mb.advantages for mb in minibatch] for minibatch in minibatches
    ] == given  # the given micro-batches are untouched
    weights, _ = mismatch_weights(
        old_log_probs, batch.rollout_log_probs, batch.response_mask, mode, 1.5, algorithm.loss.log_ratio_clamp
    )
    whole = weighted_advantages(batch.advantages, weights)
    for mb in (mb for minibatch in result.minibatches for mb in minibatch):
        expected = whole[mb.rows]
        expected = expected[:, : mb.tokens.shape[1]] if expected.dim() > 1 else expected
        torch.testing.assert_close(mb.advantages, expected)


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_dropped_rejections_leave_the_masks_and_the_denominators(mode):
    """mismatch_rejected=drop (verl rollout_rs): a rejected token (row) leaves its micro-batch's response
    mask and each mini-batch's token (sequence) count loses exactly those; kept tokens are untouched."""
    from gspo_megatron.algorithms.config import AlgorithmConfig, MismatchConfig
    from gspo_megatron.algorithms.losses import LossConfig
    from gspo_megatron.algorithms.mismatch_correction import mismatch_weights
    from gspo_megatron.loop.corrections import correct_mismatch

    torch.manual_seed(0)
    batch = _batch([1, 30, 2, 3, 2, 28, 1, 4])
    old_log_probs = batch.rollout_log_probs + 0.5 * torch.randn_like(batch.rollout_log_probs)
    mismatch = MismatchConfig(correction=mode, cap=1.2, rejected="drop")
    algorithm = AlgorithmConfig(loss=LossConfig(name="grpo"), mismatch=mismatch)
    minibatches = partition(batch, updates=2, micro_batch_size=4, dp_size=1, dp_rank=0, micro_batch_tokens=12)
    totals = step_totals(batch, 2)
    result = correct_mismatch(batch, old_log_probs, minibatches, algorithm, totals)
    after, minibatches = result.totals, result.minibatches
    weights, _ = mismatch_weights(old_log_probs, batch.rollout_log_probs, batch.response_mask, mode, 1.2)
    keep = weights > 0 if weights.dim() == 2 else (weights > 0).unsqueeze(-1).expand_as(batch.response_mask)
    expected_mask = batch.response_mask.bool() & keep
    assert 0 < int(expected_mask.sum()) < int(batch.response_mask.sum())  # some, not all, rejected
    per_update = expected_mask.reshape(2, 4, -1)
    torch.testing.assert_close(after.update_tokens, per_update.sum((1, 2)).float())
    torch.testing.assert_close(after.update_sequences, (per_update.sum(2) > 0).sum(1).float())
    for mb in (mb for minibatch in minibatches for mb in minibatch):
        torch.testing.assert_close(mb.response_mask, expected_mask[mb.rows, : mb.seq_len].float())
