"""The CP sequence split (megatron's 2*CP-chunk load balance), the causal mask over gathered keys,
and the rollout-batch padding -- single process, hand-computed values."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.contracts.batch import RolloutBatch
from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.policy.parallel.context_parallel import (
    causal_mask_for_rank,
    chunk_positions,
    pad_for_context_parallel,
    pad_sequence_length,
    split_micro_batch,
    split_sequence,
)


def test_chunk_positions_are_megatrons_load_balanced_chunks():
    # S=8, cp=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # every position exactly once over the CP group
    held = torch.cat([chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))


def test_without_context_parallelism_any_length_is_whole():
    assert chunk_positions(7, 1, 0).tolist() == list(range(7))  # odd lengths are fine at cp=1
    x = torch.arange(7).view(1, 7)
    batch = MicroBatch(tokens=x, targets=x)
    assert split_micro_batch(batch, 1, 0) is batch


def test_split_refuses_lengths_not_divisible_by_two_cp():
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 4"):
        chunk_positions(10, 2, 0)


def test_split_matches_megatron_get_batch_on_this_cp_rank():
    # megatron.core.utils.get_batch_on_this_cp_rank, written out: view as 2*cp chunks, pick r, 2cp-1-r
    x = torch.arange(2 * 12 * 3).reshape(2, 12, 3)
    cp = 3
    for rank in range(cp):
        chunks = x.view(2, 2 * cp, 12 // (2 * cp), 3)
        expected = chunks[:, [rank, 2 * cp - 1 - rank]].reshape(2, -1, 3)
        assert torch.equal(split_sequence(x, cp, rank), expected)


def test_split_micro_batch_splits_per_token_tensors_only():
    batch = MicroBatch(
        tokens=torch.arange(8).view(1, 8),
        targets=torch.arange(1, 9).view(1, 8),
        advantages=torch.tensor([0.5]),
        routed_experts=torch.arange(8 * 2 * 2).view(1, 8, 2, 2),
        rows=torch.tensor([4]),
    )
    local = split_micro_batch(batch, 2, 1)
    assert local.tokens.tolist() == [[2, 3, 4, 5]] and local.targets.tolist() == [[3, 4, 5, 6]]
    assert torch.equal(local.routed_experts, batch.routed_experts[:, 2:6])
    assert torch.equal(local.advantages, batch.advantages) and torch.equal(local.rows, batch.rows)
    assert local.old_log_probs is None  # fields not set stay unset


def test_causal_mask_is_the_full_causal_mask_at_held_positions():
    seq, cp = 8, 2
    full = torch.ones(seq, seq).tril().bool()  # full[q, k]: k <= q
    for rank in range(cp):
        q = chunk_positions(seq, cp, rank)
        k = torch.cat([chunk_positions(seq, cp, r) for r in range(cp)])
        assert torch.equal(causal_mask_for_rank(seq // cp, cp, rank), full[q][:, k])
    # rank 0's first query (position 0) sees only itself; its last (position 7) sees everything
    mask = causal_mask_for_rank(4, 2, 0)
    assert mask[0].sum() == 1 and mask[3].all()


def test_pad_for_context_parallel_pads_inputs_to_a_multiple_of_two_cp():
    n, s = 2, 7  # S-1 = 6 model inputs -> padded to 8 for cp=2
    batch = RolloutBatch(
        tokens=torch.ones(n, s, dtype=torch.long),
        response_mask=torch.ones(n, s - 1),
        input_mask=torch.ones(n, s - 1),
        rollout_log_probs=torch.full((n, s - 1), -1.0),
        advantages=torch.ones(n),
        rewards=torch.ones(n),
        shaped_rewards=torch.ones(n),
        prompt_lengths=torch.tensor([2, 3]),
        response_lengths=torch.tensor([4, 3]),
        routed_experts=torch.ones(n, s - 1, 2, 2, dtype=torch.int32),
    )
    padded = pad_for_context_parallel(batch, 2)
    assert padded.tokens.shape == (n, 9) and padded.response_mask.shape == (n, 8)
    assert padded.routed_experts.shape == (n, 8, 2, 2)
    # the padding routes to experts 0..k-1: k distinct experts, as megatron 0.19's dispatcher needs (it failed on 0, 0)
    assert padded.routed_experts[:, 6:].tolist() == [[[[0, 1], [0, 1]]] * 2] * n
    assert torch.equal(padded.routed_experts[:, :6], batch.routed_experts)
    assert padded.response_mask[:, 6:].sum() == 0 and padded.input_mask[:, 6:].sum() == 0
    assert torch.equal(padded.rollout_log_probs[:, :6], batch.rollout_log_probs)
    assert torch.equal(padded.advantages, batch.advantages)
    assert pad_for_context_parallel(batch, 1) is batch
    sequence_parallel = pad_sequence_length(batch, 4)  # TP = 4 under sequence parallelism: 6 -> 8 inputs
    assert sequence_parallel.tokens.shape == (n, 9) and pad_sequence_length(sequence_parallel, 4) is sequence_parallel
