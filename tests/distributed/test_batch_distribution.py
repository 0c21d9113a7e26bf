"""Per-rank batch distribution on two gloo ranks (DP = 2): each rank receives only its rows, half of
the whole batch's bytes, and cuts from them exactly the micro-batches it would cut from the whole
batch; the step totals are the whole batch's counts."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.contracts.samples import Sample
from gspo_megatron.rollout.pack import pack_samples
from gspo_megatron.testing.distributed import run_distributed

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

    from gspo_megatron.contracts.batch import cut_micro_batches, partition
    from gspo_megatron.contracts.share import RankShare, step_totals
    from gspo_megatron.loop.distribute import data_parallel_rank_of_each_rank, rank_shares, scatter_shares, share_bytes

    dist.init_process_group("gloo")
    dp_rank_of = data_parallel_rank_of_each_rank(ctx.rank)  # here every rank is its own DP rank
    whole = whole_batch()
    shares = None
    if ctx.rank == 0:
        shares = rank_shares(
            whole,
            {"rollout/x": 1.0},
            dp_size=2,
            updates=UPDATES,
            micro_batch_size=3,
            micro_batch_tokens=micro_batch_tokens,
            seq_multiple=1,
        )
    share = scatter_shares(shares, dp_rank_of)
    got = cut_micro_batches(share.batch, share.plan)
    expected = partition(
        whole, updates=UPDATES, micro_batch_size=3, dp_size=2, dp_rank=ctx.rank, micro_batch_tokens=micro_batch_tokens
    )
    assert len(got) == len(expected) == UPDATES
    for minibatch, part_expected in zip(got, expected, strict=True):
        assert len(minibatch) == len(part_expected)
        for mb, mb_expected in zip(minibatch, part_expected, strict=True):
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


def rejection_worker(ctx, mismatch: dict):
    """Each DP rank drops the rejected tokens of its own rows; the totals it then divides by are the
    whole batch's kept counts, the same on both ranks."""
    import torch.distributed as dist

    from gspo_megatron.algorithms.config import AlgorithmConfig, MismatchConfig
    from gspo_megatron.algorithms.losses import LossConfig
    from gspo_megatron.contracts.batch import cut_micro_batches
    from gspo_megatron.loop.corrections import correct_mismatch
    from gspo_megatron.loop.distribute import data_parallel_rank_of_each_rank, rank_shares, scatter_shares

    dist.init_process_group("gloo")
    whole = whole_batch()
    old_log_probs = _old_log_probs(whole)
    shares = (
        rank_shares(whole, {}, dp_size=2, updates=UPDATES, micro_batch_size=3, micro_batch_tokens=24, seq_multiple=1)
        if ctx.rank == 0
        else None
    )
    share = scatter_shares(shares, data_parallel_rank_of_each_rank(ctx.rank))
    minibatches = cut_micro_batches(share.batch, share.plan)
    algorithm = AlgorithmConfig(loss=LossConfig(name="grpo"), mismatch=MismatchConfig(**mismatch))
    result = correct_mismatch(
        share.batch, old_log_probs[share.batch.row_ids], minibatches, algorithm, share.totals, dist.group.WORLD
    )
    minibatches, totals = result.minibatches, result.totals
    kept = {
        int(row): mb.response_mask[i].sum().item()
        for minibatch in minibatches
        for mb in minibatch
        for i, row in enumerate(mb.rows)
    }
    return {"sequences": totals.update_sequences.tolist(), "tokens": totals.update_tokens.tolist(), "kept": kept}


def _old_log_probs(batch):
    gen = torch.Generator().manual_seed(8)
    return batch.rollout_log_probs + 0.4 * torch.randn(batch.rollout_log_probs.shape, generator=gen)


def _mask_drop(mode: str, **extra) -> dict:
    return dict(correction=mode, cap=1.3, rejected="drop", **extra)


REJECTIONS = {
    "token_mask": _mask_drop("token_mask"),
    "sequence_mask": _mask_drop("sequence_mask"),
    "icepop_band": _mask_drop("token_mask", lower=0.8),
    "sequence_rs": dict(reject="sequence", reject_upper=2.5),
    "geometric_rs_veto": dict(reject="geometric", reject_upper=1.2, veto=0.5),
    "truncate_and_token_rs": dict(correction="token_truncate", reject="token", reject_upper=1.5),
}


def _expected_kept(batch, kwargs: dict) -> torch.Tensor:
    """What one rank keeps of the whole batch: the mask mode's rejections, then rejection sampling's."""
    from gspo_megatron.algorithms.mismatch_correction import mismatch_weights, rejected_mask
    from gspo_megatron.algorithms.mismatch_rejection import rejection_keep_mask

    old = _old_log_probs(batch)
    kept = batch.response_mask.bool()
    mode = kwargs.get("correction", "none")
    if kwargs.get("rejected") == "drop":
        weights, _ = mismatch_weights(
            old, batch.rollout_log_probs, batch.response_mask, mode, 1.3, lower=kwargs.get("lower", 0.0)
        )
        kept &= rejected_mask(weights, batch.response_mask, mode)
    if "reject" in kwargs or "veto" in kwargs:
        keep, _ = rejection_keep_mask(
            old,
            batch.rollout_log_probs,
            batch.response_mask,
            kwargs.get("reject", "none"),
            kwargs.get("reject_upper", 2.0),
            veto=kwargs.get("veto"),
        )
        kept &= keep
    return kept.float()


@pytest.mark.parametrize("name", list(REJECTIONS))
def test_dropped_rejections_reduce_the_denominators_over_data_parallel_ranks(name):
    """Mask modes with mismatch_rejected=drop (IcePop's band too), rejection sampling at each level and the veto:
    each data-parallel rank rejects from its own rows what one rank rejects from the whole batch, and both
    divide by the whole batch's kept counts."""
    first, second = run_distributed(rejection_worker, 2, REJECTIONS[name], timeout=300)
    batch = whole_batch()
    kept = _expected_kept(batch, REJECTIONS[name])
    assert 0 < kept.sum() < batch.response_mask.sum()  # some tokens rejected, not all
    halves = kept.reshape(UPDATES, 8, -1)
    for rank in (first, second):
        assert rank["tokens"] == halves.sum((1, 2)).tolist()
        assert rank["sequences"] == (halves.sum(2) > 0).sum(1).float().tolist()
    assert sorted({**first["kept"], **second["kept"]}) == list(range(16))
    for row, count in {**first["kept"], **second["kept"]}.items():
        assert count == kept[row].sum().item()
