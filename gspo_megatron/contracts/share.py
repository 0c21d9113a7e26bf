"""What one data-parallel rank receives for a step: its rows, its micro-batch plan and the counts of the
whole batch that its loss denominators need (``loop/distribute.py`` sends it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gspo_megatron.contracts.batch import MicroBatchRows, RolloutBatch


@dataclass
class StepTotals:
    """Counts over the whole step's batch, the same on every rank."""

    update_sequences: torch.Tensor  # float [updates]: rows with >= 1 response token, per mini-batch
    update_tokens: torch.Tensor  # float [updates]: response tokens per mini-batch
    input_tokens: float  # real (non-padding) input tokens of the whole batch


@dataclass
class RankShare:
    """What one data-parallel rank receives for a step."""

    batch: RolloutBatch  # its rows only (``row_ids``); the whole batch where DP = 1
    plan: list[list[MicroBatchRows]]  # its micro-batches per mini-batch (global row ids, width)
    totals: StepTotals
    metrics: dict[str, Any]  # the driver's rollout metrics


def step_totals(batch: RolloutBatch, updates: int) -> StepTotals:
    """Denominators of every mini-batch (rows ``[u * N/updates, (u+1) * N/updates)``) of a whole batch."""
    per_update = batch.num_sequences // updates
    masks = batch.response_mask.reshape(updates, per_update, -1)
    return StepTotals(
        update_sequences=(masks.sum(2) > 0).sum(1).float(),
        update_tokens=masks.sum((1, 2)),
        input_tokens=float(batch.input_mask.sum()),
    )
