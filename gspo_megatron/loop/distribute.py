"""Each data-parallel rank receives only its rows of the step's batch: the loop's feed on every rank.

``DriverFeed`` (the driver, which holds the rollout side) and ``FollowerFeed`` (every other rank) are the
two ends of one ``BatchFeed``: the loop asks its feed for this rank's share of a step, for the
evaluation's metrics, and for the rollout state a checkpoint holds, and never asks which end it holds.

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

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gspo_megatron.contracts.batch import RolloutBatch, plan_partition, planned_rows
from gspo_megatron.contracts.share import RankShare, step_totals
from gspo_megatron.policy.parallel.context_parallel import pad_sequence_length
from gspo_megatron.rollout.side import RolloutSide


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


@dataclass(frozen=True)
class SharePlan:
    """How a step's batch is cut into the ranks' shares: the layout's and the trainer section's numbers."""

    dp_size: int  # data-parallel ranks
    updates: int  # trainer.updates_per_rollout: mini-batches per step
    micro_batch_size: int  # trainer.micro_batch_size
    micro_batch_tokens: int | None  # trainer.micro_batch_tokens
    seq_multiple: int  # the fed length's multiple (TP under sequence parallelism, CP)


class BatchFeed(Protocol):
    def share(self, step: int) -> RankShare:
        """This rank's rows of step ``step``'s batch, its micro-batch plan, the whole batch's counts."""

    def evaluate(self) -> dict[str, float]:
        """The evaluation's metrics (the driver evaluates; every rank gets them)."""

    def before_weight_sync(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class DriverFeed:
    """The driver's end: the rollout side's batch, cut into every data-parallel rank's share and scattered."""

    def __init__(self, rollout: RolloutSide, plan: SharePlan, dp_rank_of: list[int]) -> None:
        self.rollout, self.plan, self.dp_rank_of = rollout, plan, dp_rank_of

    def share(self, step: int) -> RankShare:
        batch, metrics = self.rollout.take(step)
        plan = self.plan
        shares = rank_shares(
            # TP under sequence parallelism and CP split the fed length: pad it to their multiple
            pad_sequence_length(batch, plan.seq_multiple),
            metrics,  # the loop copies before adding to it
            dp_size=plan.dp_size,
            updates=plan.updates,
            micro_batch_size=plan.micro_batch_size,
            micro_batch_tokens=plan.micro_batch_tokens,
            seq_multiple=plan.seq_multiple,
        )
        return scatter_shares(shares, self.dp_rank_of)

    def evaluate(self) -> dict[str, float]:
        payload: list[Any] = [self.rollout.evaluate()]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def before_weight_sync(self) -> None:
        self.rollout.before_weight_sync()

    def state_dict(self) -> dict:
        return self.rollout.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rollout.load_state_dict(state)

    def close(self) -> None:
        self.rollout.close()


class FollowerFeed:
    """Every other rank's end: its share arrives from the driver, and the evaluation's metrics. It holds no
    rollout state (the driver's goes into the checkpoint)."""

    def __init__(self, dp_rank_of: list[int]) -> None:
        self.dp_rank_of = dp_rank_of

    def share(self, step: int) -> RankShare:
        return scatter_shares(None, self.dp_rank_of)

    def evaluate(self) -> dict[str, float]:
        payload: list[Any] = [None]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def before_weight_sync(self) -> None:
        return None

    def state_dict(self) -> dict:
        return {"task": None, "rollout_scheduler": None, "partial_rollouts": None}

    def load_state_dict(self, state: dict) -> None:
        return None

    def close(self) -> None:
        return None
