"""Each data-parallel rank receives only its rows of the step's batch.

The driver (global rank 0) holds the whole ``RolloutBatch`` after the rollout phase. It plans every
data-parallel rank's micro-batches from the row lengths (``batch.plan_partition``: the plan each
rank would compute from the whole batch), selects the rows each plan names, and
scatters to every global rank only the share of its data-parallel rank
(``torch.distributed.scatter_object_list``: one object arrives at each rank, its own). A rank's
batch memory and received bytes are therefore O(N / DP); its TP/PP/CP/EP peers (same data-parallel
rank) receive the same share. Routed experts travel only where the batch has them (R3 or the
rollout-vs-train diagnostics asked the engine for them).

Whole-batch quantities a rank cannot compute from its rows travel with the share (``StepTotals``,
O(updates) numbers): the loss denominators of every mini-batch (response tokens, sequences with a
response) and the real input tokens of the step. Sums over rows (mismatch, entropy, importance
weights) are reduced over the data-parallel group where they are formed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gspo_megatron.contracts.batch import RolloutBatch, plan_partition, planned_rows
from gspo_megatron.contracts.share import RankShare, step_totals


def rank_shares(
    batch: RolloutBatch,
    metrics: dict[str, Any],
    *,
    dp_size: int,
    updates: int,
    micro_batch_size: int,
    micro_batch_tokens: int | None,
    seq_multiple: int,
) -> list[RankShare]:
    """The share of each data-parallel rank of a whole (CP-padded) batch, on the driver."""
    totals = step_totals(batch, updates)
    shares = []
    for dp_rank in range(dp_size):
        plan = plan_partition(
            batch,
            updates=updates,
            micro_batch_size=micro_batch_size,
            dp_size=dp_size,
            dp_rank=dp_rank,
            micro_batch_tokens=micro_batch_tokens,
            seq_multiple=seq_multiple,
        )
        rows = batch if dp_size == 1 else batch.select(planned_rows(plan))
        shares.append(RankShare(batch=rows, plan=plan, totals=totals, metrics=metrics))
    return shares


def data_parallel_rank_of_each_rank(dp_rank: int) -> list[int]:
    """Collective, once: the data-parallel rank of every global rank (index = global rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [dp_rank]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, dp_rank)
    return [int(rank) for rank in out]


def scatter_shares(shares: list[RankShare] | None, dp_rank_of: list[int]) -> RankShare:
    """Collective: global rank k receives ``shares[dp_rank_of[k]]`` (``shares`` given on rank 0 only)."""
    if len(dp_rank_of) == 1:
        if shares is None:
            raise ValueError("a single rank must pass its shares")
        return shares[0]
    received: list[Any] = [None]
    outgoing = None if shares is None else [shares[dp] for dp in dp_rank_of]
    dist.scatter_object_list(received, outgoing, src=0)
    return received[0]


def share_bytes(share: RankShare) -> int:
    """Bytes of the batch tensors in a share (what a rank holds of the step's rows)."""
    return sum(
        value.numel() * value.element_size() for value in vars(share.batch).values() if isinstance(value, torch.Tensor)
    )
