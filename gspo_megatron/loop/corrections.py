"""Apply the train/inference mismatch correction to a step's micro-batches (after old log-probs).

The weights are computed per row from the rows this rank holds and folded into each micro-batch's
advantages; their metrics are reduced over the data-parallel ranks. Tokens are rejected -- by a mask
mode with ``algorithm.mismatch.rejected=drop``, by rejection sampling (``algorithm.mismatch.reject``) or
by the veto (``algorithm.mismatch.veto``) -- by leaving each micro-batch's response mask. The phase
returns new micro-batches with those advantages and masks (``MismatchResult``; nothing is written into
the ones it was given), and the
step's denominators (``StepTotals``, counted before the correction) lose them: the counts removed per
mini-batch are summed over the data-parallel ranks, so every rank divides by the same whole-batch
totals (verl ``rollout_rs``). See ``algorithms/mismatch_correction.py`` and
``algorithms/mismatch_rejection.py`` for the math.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.config import AlgorithmConfig
from gspo_megatron.algorithms.losses import PER_ROW_ADVANTAGE_LOSSES
from gspo_megatron.algorithms.mismatch_correction import (
    MismatchCorrection,
    RejectedTokens,
    finalize_mismatch_weight_stats,
    mismatch_weight_stats,
    rejected_mask,
    weighted_advantages,
)
from gspo_megatron.algorithms.mismatch_rejection import (
    RejectionLevel,
    finalize_rejection_stats,
    rejection_keep_mask,
)
from gspo_megatron.algorithms.reductions import all_reduce_metrics
from gspo_megatron.contracts.batch import RolloutBatch
from gspo_megatron.contracts.micro_batch import StepMicroBatch
from gspo_megatron.contracts.share import StepTotals


@dataclass(frozen=True)
class MismatchResult:
    metrics: dict[str, float]
    minibatches: list[list[StepMicroBatch]]  # the step's micro-batches with corrected advantages and masks
    totals: StepTotals  # the denominators less the rejected tokens


def correct_mismatch(
    batch: RolloutBatch,
    old_log_probs: torch.Tensor,
    minibatches: list[list[StepMicroBatch]],
    algorithm: AlgorithmConfig,
    totals: StepTotals,
    dp_group: dist.ProcessGroup | None = None,
) -> MismatchResult:
    """Re-weight the advantages of every micro-batch in ``minibatches`` by pi_old (``old_log_probs``, this rank's
    rows) over the engine's; returns the weights' metrics, the re-weighted micro-batches and the step's
    denominators (less the rejected tokens: module docstring).

    ``batch`` holds this rank's rows; the metrics cover every data-parallel rank's rows when
    ``dp_group`` is given (sums and counts summed, extremes reduced over it)."""
    metrics: dict[str, float] = {}
    valid = batch.mismatch_mask.bool()
    rejected = torch.zeros_like(valid)  # valid tokens that leave the loss (and its denominators)
    drops_masked = algorithm.mismatch.rejected == RejectedTokens.drop
    rejects = algorithm.mismatch.reject != RejectionLevel.none or algorithm.mismatch.veto is not None
    if algorithm.mismatch.correction != MismatchCorrection.none:
        weights, weight_metrics, minibatches = _weigh_advantages(batch, old_log_probs, minibatches, algorithm, dp_group)
        metrics.update(weight_metrics)
        if drops_masked:
            rejected |= valid & ~rejected_mask(weights, batch.mismatch_mask, algorithm.mismatch.correction)
    if rejects:
        kept, stats = rejection_keep_mask(
            old_log_probs,
            batch.rollout_log_probs,
            batch.mismatch_mask,
            algorithm.mismatch.reject,
            algorithm.mismatch.reject_upper,
            algorithm.mismatch.reject_lower,
            algorithm.mismatch.veto,
        )
        if dp_group is not None:
            stats = all_reduce_metrics(stats, dp_group)
        metrics.update(finalize_rejection_stats(stats))
        rejected |= valid & ~kept
    # the config's answer, the same on every data-parallel rank: the reduction is collective
    if drops_masked or rejects:
        minibatches, totals = _drop_rejected(minibatches, batch, rejected, totals, dp_group)
    return MismatchResult(metrics, minibatches, totals)


def _weigh_advantages(
    batch: RolloutBatch,
    old_log_probs: torch.Tensor,
    minibatches: list[list[StepMicroBatch]],
    algorithm: AlgorithmConfig,
    dp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, dict[str, float], list[list[StepMicroBatch]]]:
    """Each micro-batch's advantages times its rows' importance weights; returns the weights (this rank's
    rows), their metrics over every data-parallel rank, and the re-weighted micro-batches."""
    weights, stats = mismatch_weight_stats(
        old_log_probs,
        batch.rollout_log_probs,
        batch.mismatch_mask,
        algorithm.mismatch.correction,
        algorithm.mismatch.cap,
        algorithm.loss.log_ratio_clamp,
        algorithm.mismatch.sequence_ratio,
        algorithm.mismatch.lower,
        per_row=algorithm.loss.name in PER_ROW_ADVANTAGE_LOSSES,
    )
    if dp_group is not None:
        stats = all_reduce_metrics(stats, dp_group)

    def weighed(mb: StepMicroBatch) -> StepMicroBatch:
        # token-budget micro-batches hold any rows, cut to their own width
        rows, width = batch.local(mb.rows), mb.seq_len
        advantages, row_weights = batch.advantages[rows], weights[rows]
        advantages = advantages[:, :width] if advantages.dim() > 1 else advantages
        row_weights = row_weights[:, :width] if row_weights.dim() > 1 else row_weights
        return replace(mb, advantages=weighted_advantages(advantages, row_weights))

    metrics = {key: float(value) for key, value in finalize_mismatch_weight_stats(stats).items()}
    return weights, metrics, [[weighed(mb) for mb in minibatch] for minibatch in minibatches]


def _drop_rejected(
    minibatches: list[list[StepMicroBatch]],
    batch: RolloutBatch,
    rejected: torch.Tensor,
    totals: StepTotals,
    dp_group: dist.ProcessGroup | None,
) -> tuple[list[list[StepMicroBatch]], StepTotals]:
    """Take the ``rejected`` tokens ([B, T], this rank's rows) out of each micro-batch's response mask (new
    micro-batches); the totals lose them too (collective over ``dp_group``: every rank calls it when any
    may reject).

    N_tok(u) -= sum over ranks of the rejected tokens of mini-batch u
    N_seq(u) -= sum over ranks of its rows left with no valid token"""
    removed = torch.zeros(len(minibatches), 2, dtype=torch.float64)  # [update, (tokens, sequences)]
    kept_parts = []
    for update, micro_batches in enumerate(minibatches):
        kept = []
        for mb in micro_batches:
            rows, width, before = batch.local(mb.rows), mb.seq_len, mb.response_mask
            after = before.bool() & ~rejected[rows][:, :width]
            removed[update, 0] += float(before.sum() - after.sum())
            removed[update, 1] += float(((before.sum(-1) > 0) & ~after.any(-1)).sum())
            kept.append(replace(mb, response_mask=after.to(before.dtype)))
        kept_parts.append(kept)
    if dp_group is not None:
        dist.all_reduce(removed, group=dp_group)
    totals = replace(
        totals,
        update_tokens=totals.update_tokens - removed[:, 0].to(totals.update_tokens.dtype),
        update_sequences=totals.update_sequences - removed[:, 1].to(totals.update_sequences.dtype),
    )
    return kept_parts, totals
