"""The multi-rank test harness: results come back per rank, failures name their rank."""

import pytest
import torch
import torch.distributed as dist

from gspo_megatron.testing.distributed import DistributedRunError, run_distributed

pytestmark = pytest.mark.distributed


def _all_reduce_rank(ctx, offset):
    dist.init_process_group("gloo")
    value = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(value)
    return ctx.rank, value.item()


def _fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one is broken")
    return ctx.rank


def test_results_come_back_in_rank_order():
    results = run_distributed(_all_reduce_rank, 3, 10)
    assert results == [(0, 33.0), (1, 33.0), (2, 33.0)]


def test_failure_names_the_rank_and_cause():
    with pytest.raises(DistributedRunError, match=r"(?s)rank 1.*rank one is broken"):
        run_distributed(_fail_on_rank_one, 2)
