"""Token-budget micro-batches (``trainer.micro_batch_tokens``): sorted by length, padded per micro-batch.

Without a budget every micro-batch is padded to the longest row of the whole rollout; with
long-tailed response lengths most of that is padding. With a budget B the rows of one mini-batch
are sorted by length (longest first) and packed greedily into micro-batches of b rows per
data-parallel rank with

    b * (W - 1) <= B        W = the longest row (prompt + response tokens) of the micro-batch,

each cut to its own width W (one row longer than B goes alone). Dropping trailing padding changes
nothing a causal model computes at the kept positions, and loss denominators are counts of the
whole mini-batch (``PolicyLossHead``), so the gradient is the one of the unsplit mini-batch.

Design decisions:
- One plan for all data-parallel ranks: the sorted rows are cut into stripes of ``dp`` consecutive
  rows, stripe row r going to rank r; micro-batch j then has the same [b, W] shape on every rank.
  With ``model.token_dispatcher=allgather`` expert-parallel all-gathers span data-parallel ranks, so
  the token counts of one micro-batch index must agree across them (the alltoall dispatcher takes
  any counts); and every rank runs the same number of micro-batches.
- The driver computes every rank's plan from the row lengths of the whole batch and sends each rank
  its own with its rows (``batch_distribution.py``), with the step's real input-token count, so the
  padded-token fraction of the step is known everywhere.
- Under pipeline parallelism the shapes differ between micro-batches of one schedule call:
  ``policy/models/schedule.py`` turns on megatron's ``variable_seq_lengths`` (stages exchange shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gspo_megatron.contracts.micro_batch import MicroBatch


@dataclass
class MicroBatchPlan:
    rows: torch.Tensor  # long [dp, b]: global row indices, rank r's rows in rows[r]
    width: int  # tokens per row (prompt + response, before the next-token shift)


def token_budget_plan(
    lengths: torch.Tensor, *, first_row: int, dp_size: int, budget: int, multiple: int = 1, max_width: int | None = None
) -> list[MicroBatchPlan]:
    """The micro-batches of one mini-batch whose rows are ``first_row + i`` with lengths ``lengths[i]``.

    ``multiple``: the fed length W - 1 is rounded up to a multiple of it (sequence parallelism splits
    the sequence over tp ranks), but never beyond ``max_width`` (the padded batch's width).
    """
    if budget < 1:
        raise ValueError(f"trainer.micro_batch_tokens must be >= 1, got {budget}")
    if lengths.numel() % dp_size:
        raise ValueError(f"{lengths.numel()} rows cannot be split evenly over {dp_size} data-parallel ranks")
    order = sorted(range(lengths.numel()), key=lambda i: (-int(lengths[i]), i))  # longest first, stable
    stripes = [order[i : i + dp_size] for i in range(0, len(order), dp_size)]
    plans: list[MicroBatchPlan] = []
    current: list[list[int]] = []
    width = 0
    for stripe in stripes:
        # rows come longest first: a micro-batch's first stripe sets its width
        if current and (len(current) + 1) * (width - 1) > budget:
            plans.append(_plan(current, first_row, width))
            current = []
        if not current:
            width = _rounded(max(int(lengths[i]) for i in stripe), multiple, max_width)
        current.append(stripe)
    if current:
        plans.append(_plan(current, first_row, width))
    return plans


def _rounded(width: int, multiple: int, max_width: int | None) -> int:
    fed = -(-(width - 1) // multiple) * multiple
    return fed + 1 if max_width is None else min(fed + 1, max_width)


def _plan(stripes: list[list[int]], first_row: int, width: int) -> MicroBatchPlan:
    rows = torch.tensor(stripes, dtype=torch.long).t().contiguous() + first_row
    return MicroBatchPlan(rows=rows, width=width)


def step_padded_fraction(input_tokens: float, minibatches: Sequence[Sequence[MicroBatch]], dp_size: int) -> float:
    """1 - real input tokens of the whole step / tokens fed in one pass over its micro-batches, all ranks.

    Every data-parallel rank feeds micro-batches of the same shapes (the plan above; without a
    budget: equal slices padded to the batch width), so this rank's shapes times ``dp_size`` are
    the whole step's.
    """
    return step_fed_shape(minibatches, dp_size).padded_fraction(input_tokens)


@dataclass(frozen=True)
class FedShape:
    """What one RL step fed the model in its update passes, padding included, over all data-parallel
    ranks (``tools/plan.py --calibrate`` plans exactly this shape to fit its time model)."""

    rows: int
    tokens: int
    micro_batches_per_rank: int  # over all of the step's updates

    def padded_fraction(self, input_tokens: float) -> float:
        """1 - real input tokens / tokens fed (``step_padded_fraction``)."""
        return 1.0 - input_tokens / self.tokens if self.tokens else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "batch/fed_rows": float(self.rows),
            "batch/fed_tokens": float(self.tokens),
            "batch/micro_batches_per_rank": float(self.micro_batches_per_rank),
        }


def step_fed_shape(minibatches: Sequence[Sequence[MicroBatch]], dp_size: int) -> FedShape:
    """Every data-parallel rank feeds micro-batches of the same shapes (see above): this rank's x dp."""
    rows = dp_size * sum(mb.tokens.shape[0] for minibatch in minibatches for mb in minibatch)
    tokens = dp_size * sum(mb.tokens.numel() for minibatch in minibatches for mb in minibatch)
    return FedShape(rows, tokens, sum(len(minibatch) for minibatch in minibatches))
