"""Volatility and expert load merged over 2 gloo ranks equal the single-process numbers for all tokens.

Lives beside the unit tests it extends (the tier is marked ``distributed``).
"""

import pytest
import torch

from gspo_megatron.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _routings():
    generator = torch.Generator().manual_seed(3)
    probs = torch.rand(12, 4, 8, generator=generator)
    a = probs.topk(2, dim=-1).indices
    b = (probs + 0.4 * torch.rand(12, 4, 8, generator=generator)).topk(2, dim=-1).indices
    mask = torch.rand(12, generator=generator) > 0.25
    return a, b, mask


def _rank_fn(ctx):
    import torch.distributed as dist

    from gspo_megatron.policy.routing.volatility import (
        all_reduce_expert_load,
        all_reduce_volatility,
        expert_load,
        routing_volatility,
    )

    dist.init_process_group("gloo", rank=ctx.rank, world_size=ctx.world_size)
    a, b, mask = _routings()
    # uneven shards: rank 0 gets 5 tokens, rank 1 gets 7
    shard = slice(0, 5) if ctx.rank == 0 else slice(5, 12)
    volatility = all_reduce_volatility(routing_volatility(a[shard], b[shard], mask[shard]))
    load = all_reduce_expert_load(expert_load(b[shard], 8, mask[shard]))
    return (volatility.changed_count, volatility.intersection_count, volatility.tokens, load.counts, load.tokens)


def test_all_reduce_equals_whole_batch():
    from gspo_megatron.policy.routing.volatility import expert_load, routing_volatility

    a, b, mask = _routings()
    whole = routing_volatility(a, b, mask)
    whole_load = expert_load(b, 8, mask)
    for changed, intersection, tokens, counts, load_tokens in run_distributed(_rank_fn, 2, timeout=120):
        assert torch.equal(changed, whole.changed_count)
        assert torch.equal(intersection, whole.intersection_count)
        assert int(tokens) == int(whole.tokens) == int(mask.sum())
        assert torch.equal(counts, whole_load.counts) and int(load_tokens) == int(mask.sum())
    assert 0 < whole.changed_count.sum() < whole.tokens * 4  # the data has both changed and kept routes
