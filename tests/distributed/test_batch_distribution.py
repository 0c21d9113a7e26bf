"""Per-rank batch distribution on two gloo ranks (DP = 2): each rank receives only its rows, half of
the whole batch's bytes, and cuts from them exactly the micro-batches it would cut from the whole
batch; the step totals are the whole batch's counts."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.rollout.types import Sample
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.trainer.batch import pack_samples

pytestmark = pytest.mark.distributed

UPDATES = 2
LAYERS, TOP_K = 3, 2


def whole_batch():
    """16 rows with long-tailed lengths, engine log-probs and routed experts (as R3 ships them)."""
    gen = torch.Generator().manual_seed(5)
    samples = []
    for i in range(16):
        prompt = torch.randint(1, 50, (2 + i % 3,), generator=gen).tolist()
        length = 1 if i == 5 else int(2 + 20 * float(torch.rand((), generator=gen)) ** 3)
        output = torch.randint(1, 50, (length,), generator=gen).tolist()
        routed = torch.randint(0, 8, (len(prompt) + length - 1, LAYERS, TOP_K), generator=gen)
        samples.append(
            Sample(
                prompt_ids=prompt,
                output_ids=output,
                output_log_probs=-torch.rand(length, generator=gen),
                finish_reason="stop",
                routed_experts=routed,
                weight_version=0,
            )
        )
    advantages = torch.randn(16, generator=gen)
    batch = pack_samples(samples, advantages, advantages.sign(), advantages, 0, with_routed_experts=True)
    batch.response_mask[5] = 0.0  # a row without response tokens: no sequence in the denominator
    return batch


def distribution_worker(ctx, micro_batch_tokens):
    import torch.distributed as dist

    from gspo_megatron.trainer.batch import cut_micro_batches, partition
    from gspo_megatron.trainer.batch_distribution import (
        RankShare,
        data_parallel_rank_of_each_rank,
        rank_shares,
        scatter_shares,
        share_bytes,
        step_totals,
    )

    dist.init_process_group("gloo")
    dp_rank_of = data_parallel_rank_of_each_rank(ctx.rank)  # here every rank is its own DP rank
    whole = whole_batch()
    shares = None
    if ctx.rank == 0:
        shares = rank_shares(whole, {"rollout/x": 1.0}, 2, UPDATES, 3, micro_batch_tokens, 1)
    share = scatter_shares(shares, dp_rank_of)
    got = cut_micro_batches(share.batch, share.plan)
    expected = partition(whole, UPDATES, 3, 2, ctx.rank, micro_batch_tokens)
    assert len(got) == len(expected) == UPDATES
    for part, part_expected in zip(got, expected):
        assert len(part) == len(part_expected)
        for mb, mb_expected in zip(part, part_expected):
            for name, value in vars(mb_expected).items():
                other = getattr(mb, name)
                assert (other is None and value is None) or torch.equal(other, value), name
    totals = step_totals(whole, UPDATES)
    assert torch.equal(share.totals.update_tokens, totals.update_tokens)
    assert torch.equal(share.totals.update_sequences, totals.update_sequences)
    assert share.metrics == {"rollout/x": 1.0}
    whole_bytes = share_bytes(RankShare(batch=whole, plan=[], totals=totals, metrics={}))
    return {
        "rows": share.batch.row_ids.tolist(),
        "bytes": share_bytes(share),
        "whole_bytes": whole_bytes,
        "totals": (totals.update_sequences.tolist(), totals.update_tokens.tolist(), totals.input_tokens),
    }


@pytest.mark.parametrize("micro_batch_tokens", [None, 24])
def test_each_data_parallel_rank_receives_only_its_rows(micro_batch_tokens):
    first, second = run_distributed(distribution_worker, 2, micro_batch_tokens, timeout=300)
    # the two ranks hold disjoint halves of the 16 rows
    assert len(first["rows"]) == len(second["rows"]) == 8
    assert sorted(first["rows"] + second["rows"]) == list(range(16))
    if micro_batch_tokens is None:  # contiguous halves of each mini-batch of 8
        assert first["rows"] == [0, 1, 2, 3, 8, 9, 10, 11]
    # received bytes: half of the whole batch (every rank received all of it before)
    whole = first["whole_bytes"]
    for rank in (first, second):
        assert rank["bytes"] <= 0.51 * whole
    # totals by hand: row 5 (mini-batch 0) has no response tokens
    batch = whole_batch()
    sequences, tokens, inputs = first["totals"]
    assert sequences == [7.0, 8.0]
    assert tokens == [batch.response_mask[:8].sum().item(), batch.response_mask[8:].sum().item()]
    assert inputs == batch.input_mask.sum().item()
