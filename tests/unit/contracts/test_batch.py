"""pack_samples and partition (contracts/batch.py) against batches written out by hand."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.contracts.batch import partition, plan_partition
from gspo_megatron.contracts.samples import Sample, Truncation
from gspo_megatron.rollout.pack import pack_samples


def _sample(prompt, output, log_probs, routed=None, forced_mask=None) -> Sample:
    return Sample(
        prompt_ids=prompt,
        output_ids=output,
        output_log_probs=torch.tensor(log_probs),
        finish_reason="stop",
        routed_experts=routed,
        weight_version=len(prompt),
        truncation=None if forced_mask is None else Truncation("think_budget", 0, [], forced_mask.bool()),
    )


def _two_samples(**kwargs):
    samples = [
        _sample([1, 2], [3, 4], [-0.1, -0.2]),  # 4 tokens
        _sample([5], [6], [-0.3]),  # 2 tokens: padded to 4
    ]
    return pack_samples(
        samples, torch.tensor([1.0, -1.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.0]), 0, **kwargs
    )


def test_pack_samples_by_hand():
    batch = _two_samples()
    assert batch.tokens.tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    # target j scores token j+1: row 0's response tokens 3, 4 are targets 1, 2; row 1's token 6 is target 0
    assert batch.response_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    # inputs fed: every real token but the last of each row
    assert batch.input_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    torch.testing.assert_close(batch.rollout_log_probs, torch.tensor([[0.0, -0.1, -0.2], [-0.3, 0.0, 0.0]]))
    assert batch.prompt_lengths.tolist() == [2, 1] and batch.response_lengths.tolist() == [2, 1]
    assert batch.policy_versions.tolist() == [2, 1]
    assert batch.advantages.tolist() == [1.0, -1.0] and batch.shaped_rewards.tolist() == [0.5, 0.0]
    assert batch.routed_experts is None and not hasattr(batch, "old_log_probs")  # pi_old: a phase's result


def test_forced_tokens_are_context_not_actions():
    sample = _sample([1, 2], [3, 9, 4], [-0.1, -0.2, -0.3], forced_mask=torch.tensor([0, 1, 0]))
    batch = pack_samples([sample], torch.zeros(1), torch.zeros(1), torch.zeros(1), 0)
    assert batch.response_mask.tolist() == [[0, 1, 0, 1]]  # the inserted token 9 (target 2) is no action


def test_routed_experts_are_placed_at_the_fed_tokens_and_required_when_asked():
    routed0 = torch.arange(3 * 2 * 1).view(3, 2, 1)  # prompt 2 + response 2 - 1 fed tokens, 2 layers, k=1
    routed1 = torch.full((1, 2, 1), 7)
    samples = [_sample([1, 2], [3, 4], [-0.1, -0.2], routed0), _sample([5], [6], [-0.3], routed1)]
    batch = pack_samples(samples, torch.zeros(2), torch.zeros(2), torch.zeros(2), 0, with_routed_experts=True)
    assert batch.routed_experts.shape == (2, 3, 2, 1) and batch.routed_experts.dtype == torch.int32
    assert torch.equal(batch.routed_experts[0], routed0.int())
    assert batch.routed_experts[1, 0].flatten().tolist() == [7, 7] and not batch.routed_experts[1, 1:].any()
    # k = 2: padding positions hold two distinct experts (a valid top-k for megatron's token dispatch)
    two = [
        _sample([1, 2], [3, 4], [-0.1, -0.2], torch.full((3, 2, 2), 3)),
        _sample([5], [6], [-0.3], routed1.expand(1, 2, 2)),
    ]
    padded = pack_samples(two, torch.zeros(2), torch.zeros(2), torch.zeros(2), 0, with_routed_experts=True)
    assert padded.routed_experts[1, 1:].reshape(-1, 2).tolist() == [[0, 1]] * 4
    assert padded.routed_experts[1, 0].tolist() == [[7, 7], [7, 7]] and (padded.routed_experts[0] == 3).all()
    samples[1].routed_experts = None
    with pytest.raises(ValueError, match="needs routed experts from the engine"):
        pack_samples(samples, torch.zeros(2), torch.zeros(2), torch.zeros(2), 0, with_routed_experts=True)
    with pytest.raises(ValueError, match="empty list"):
        pack_samples([], torch.zeros(0), torch.zeros(0), torch.zeros(0), 0)


def _rows_batch(n: int):
    samples = [_sample([1], [2 + i, 3], [-0.1 * i, -0.5]) for i in range(n)]
    return pack_samples(samples, torch.arange(n, dtype=torch.float), torch.zeros(n), torch.zeros(n), 0)


def test_partition_gives_each_rank_contiguous_rows_of_every_mini_batch():
    batch = _rows_batch(8)
    # 2 updates of 4 rows; dp=2: rank 1 holds rows 2,3 of update 0 and 6,7 of update 1; micro-batches of 1
    parts = partition(batch, updates=2, micro_batch_size=1, dp_size=2, dp_rank=1)
    assert [[mb.rows.tolist() for mb in part] for part in parts] == [[[2], [3]], [[6], [7]]]
    mb = parts[1][0]
    assert mb.tokens.tolist() == [[1, 8]] and mb.targets.tolist() == [[8, 3]]
    assert mb.advantages.tolist() == [6.0] and mb.response_mask.tolist() == [[1, 1]]
    torch.testing.assert_close(mb.rollout_log_probs, torch.tensor([[-0.6, -0.5]]))
    assert mb.old_log_probs is None and mb.routed_experts is None
    whole = partition(batch, updates=1, micro_batch_size=3, dp_size=1, dp_rank=0)
    assert [mb.rows.tolist() for mb in whole[0]] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_the_planning_counts_are_keyword_only():
    """updates, micro_batch_size, dp_size and dp_rank are all ints: passed by position, a swap of two
    would plan a different batch silently, so they cannot be passed by position."""
    batch = _rows_batch(8)
    with pytest.raises(TypeError, match="positional argument"):
        partition(batch, 2, 1, 2, 1)
    with pytest.raises(TypeError, match="positional argument"):
        plan_partition(batch, 2, 1, 2, 1)


def test_partition_refuses_uneven_splits_naming_the_keys():
    batch = _rows_batch(6)
    with pytest.raises(ValueError, match="into 4 equal mini-batches.*trainer.updates_per_rollout"):
        partition(batch, updates=4, micro_batch_size=1, dp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match="over 4 data-parallel ranks"):
        partition(batch, updates=1, micro_batch_size=1, dp_size=4, dp_rank=0)


def _pack_row_by_row(samples, pad):
    """The definition, one row at a time: what the flat packing must equal."""
    width = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    n = len(samples)
    tokens = torch.full((n, width), pad, dtype=torch.long)
    mask, input_mask, logp = torch.zeros(n, width - 1), torch.zeros(n, width - 1), torch.zeros(n, width - 1)
    layers, k = samples[0].routed_experts.shape[1:]
    routed = torch.arange(k, dtype=torch.int32).repeat(n, width - 1, layers, 1)  # padding: experts 0..k-1
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.output_ids)
        tokens[i, : p + r] = torch.tensor(s.prompt_ids + s.output_ids)
        mask[i, p - 1 : p + r - 1] = 1.0 - (s.truncation.forced_mask.float() if s.truncation else torch.zeros(r))
        input_mask[i, : p + r - 1] = 1.0
        logp[i, p - 1 : p + r - 1] = s.output_log_probs
        routed[i, : p + r - 1] = s.routed_experts
    return tokens, mask, input_mask, logp, routed


def test_flat_packing_equals_row_by_row_on_ragged_rows():
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(23):
        p, r = (int(x) for x in torch.randint(1, 9, (2,), generator=generator))
        forced = torch.rand(r, generator=generator) < 0.3 if i % 4 == 0 else None
        samples.append(
            Sample(
                prompt_ids=torch.randint(1, 50, (p,), generator=generator).tolist(),
                output_ids=torch.randint(1, 50, (r,), generator=generator).tolist(),
                output_log_probs=-torch.rand(r, generator=generator),
                finish_reason="stop",
                routed_experts=torch.randint(0, 8, (p + r - 1, 3, 2), generator=generator, dtype=torch.int32),
                truncation=None if forced is None else Truncation("think_budget", 0, [], forced),
            )
        )
    zeros = torch.zeros(len(samples))
    batch = pack_samples(samples, zeros, zeros, zeros, pad_token_id=0, with_routed_experts=True)
    tokens, mask, input_mask, logp, routed = _pack_row_by_row(samples, pad=0)
    assert torch.equal(batch.tokens, tokens) and torch.equal(batch.response_mask, mask)
    assert torch.equal(batch.input_mask, input_mask) and torch.equal(batch.rollout_log_probs, logp)
    assert torch.equal(batch.routed_experts, routed)


def test_update_batches_carry_pi_old_cut_to_each_micro_batch_and_the_reference_in_order():
    """The updates' micro-batches are built once from what the phases returned: pi_old of the rank's rows
    cut to each micro-batch's rows and width, the reference's log-probs in flattened order; the step's
    micro-batches they come from are left as they were."""
    from gspo_megatron.contracts.batch import update_batches
    from gspo_megatron.contracts.micro_batch import UpdateMicroBatch

    batch = pack_samples(
        [_sample([1, 2], [3, 4], [-0.1, -0.2]), _sample([5], [6], [-0.3]), _sample([7], [8, 9], [-0.4, -0.5])],
        torch.tensor([1.0, -1.0, 0.5]),
        torch.tensor([1.0, 0.0, 1.0]),
        torch.tensor([0.5, 0.0, 0.5]),
        0,
    )
    parts = partition(batch, updates=1, micro_batch_size=1, dp_size=1, dp_rank=0, micro_batch_tokens=4)
    old = torch.arange(9, dtype=torch.float32).reshape(3, 3)  # pi_old per (row, target), by hand
    reference = [torch.full((mb.num_rows, mb.seq_len), float(i)) for i, mb in enumerate(parts[0])]
    updates = update_batches(parts, batch, old, reference)
    assert [[type(mb) for mb in part] for part in updates] == [[UpdateMicroBatch] * len(parts[0])]
    for i, (step_mb, mb) in enumerate(zip(parts[0], updates[0], strict=True)):
        torch.testing.assert_close(mb.old_log_probs, old[mb.rows, : mb.seq_len])
        assert torch.equal(mb.ref_log_probs, reference[i]) and mb.tokens is step_mb.tokens
        assert step_mb.old_log_probs is None and step_mb.ref_log_probs is None  # not written into
    assert sorted(int(row) for mb in updates[0] for row in mb.rows) == [0, 1, 2]
