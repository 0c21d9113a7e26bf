"""Apply the train/inference mismatch correction to a step's micro-batches (after old log-probs).

The weights are computed per row from the rows this rank holds and folded into each micro-batch's
advantages; their metrics are reduced over the data-parallel ranks. Tokens are rejected -- by a mask
mode with ``algorithm.mismatch_rejected=drop``, by rejection sampling (``algorithm.mismatch_reject``) or
by the veto (``algorithm.mismatch_veto``) -- by leaving each micro-batch's response mask, and the
step's denominators (``StepTotals``, counted before the correction) lose them: the counts removed per
mini-batch are summed over the data-parallel ranks, so every rank divides by the same whole-batch
totals (verl ``rollout_rs``). See ``algorithms/mismatch_correction.py`` and
``algorithms/mismatch_rejection.py`` for the math.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.config import AlgorithmConfig
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
from gspo_megatron.models.micro_batch import MicroBatch, required
from gspo_megatron.trainer.batch import RolloutBatch
from gspo_megatron.trainer.batch_distribution import StepTotals


def correct_mismatch(
    batch: RolloutBatch,
    parts: list[list[MicroBatch]],
    algorithm: AlgorithmConfig,
    totals: StepTotals,
    dp_group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, float], StepTotals]:
    """Re-weight the advantages of every micro-batch in ``parts``; returns the weights' metrics and
    the step's denominators (less the rejected tokens: module docstring).

    ``batch`` holds this rank's rows; the metrics cover every data-parallel rank's rows when
    ``dp_group`` is given (sums and counts summed, extremes reduced over it)."""
    old_log_probs = batch.old_log_probs
    if old_log_probs is None:
        raise RuntimeError("mismatch correction needs the old log-probs: run the old-log-prob pass first")
    metrics: dict[str, float] = {}
    valid = batch.mismatch_mask.bool()
    rejected = torch.zeros_like(valid)  # valid tokens that leave the loss (and its denominators)
    drops_masked = algorithm.mismatch_rejected == RejectedTokens.drop
    rejects = algorithm.mismatch_reject != RejectionLevel.none or algorithm.mismatch_veto is not None
    if algorithm.mismatch_correction != MismatchCorrection.none:
        weights, weight_metrics = _weigh_advantages(batch, old_log_probs, parts, algorithm, dp_group)
        metrics.update(weight_metrics)
        if drops_masked:
            rejected |= valid & ~rejected_mask(weights, batch.mismatch_mask, algorithm.mismatch_correction)
    if rejects:
        kept, stats = rejection_keep_mask(
            old_log_probs,
            batch.rollout_log_probs,
            batch.mismatch_mask,
            algorithm.mismatch_reject,
            algorithm.mismatch_reject_upper,
            algorithm.mismatch_reject_lower,
            algorithm.mismatch_veto,
        )
        if dp_group is not None:
            stats = all_reduce_metrics(stats, dp_group)
        metrics.update(finalize_rejection_stats(stats))
        rejected |= valid & ~kept
    # the config's answer, the same on every data-parallel rank: the reduction is collective
    if drops_masked or rejects:
        totals = _drop_rejected(parts, batch, rejected, totals, dp_group)
    return metrics, totals


def _weigh_advantages(
    batch: RolloutBatch,
    old_log_probs: torch.Tensor,
    parts: list[list[MicroBatch]],
    algorithm: AlgorithmConfig,
    dp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Each micro-batch's advantages times its rows' importance weights; returns the weights (this rank's rows)
    and their metrics over every data-parallel rank."""
    weights, stats = mismatch_weight_stats(
        old_log_probs,
        batch.rollout_log_probs,
        batch.mismatch_mask,
        algorithm.mismatch_correction,
        algorithm.mismatch_cap,
        algorithm.log_ratio_clamp,
        algorithm.mismatch_sequence_ratio,
        algorithm.mismatch_lower,
    )
    if dp_group is not None:
        stats = all_reduce_metrics(stats, dp_group)
    for mb in (mb for part in parts for mb in part):
        # token-budget micro-batches hold any rows, cut to their own width
        rows, width = batch.local(required(mb.rows, "rows", "mismatch correction")), mb.seq_len
        advantages, row_weights = batch.advantages[rows], weights[rows]
        advantages = advantages[:, :width] if advantages.dim() > 1 else advantages
        row_weights = row_weights[:, :width] if row_weights.dim() > 1 else row_weights
        mb.advantages = weighted_advantages(advantages, row_weights)
    return weights, {key: float(value) for key, value in finalize_mismatch_weight_stats(stats).items()}


def _drop_rejected(
    parts: list[list[MicroBatch]],
    batch: RolloutBatch,
    rejected: torch.Tensor,
    totals: StepTotals,
    dp_group: dist.ProcessGroup | None,
) -> StepTotals:
    """Take the ``rejected`` tokens ([B, T], this rank's rows) out of each micro-batch's response mask; the
    totals lose them too (collective over ``dp_group``: every rank calls it when any may reject).

    N_tok(u) -= sum over ranks of the rejected tokens of mini-batch u
    N_seq(u) -= sum over ranks of its rows left with no valid token"""
    removed = torch.zeros(len(parts), 2, dtype=torch.float64)  # [update, (tokens, sequences)]
    for update, micro_batches in enumerate(parts):
        for mb in micro_batches:
            rows, width = batch.local(required(mb.rows, "rows", "mismatch rejection")), mb.seq_len
            before = required(mb.response_mask, "response_mask", "mismatch rejection")
            after = before.bool() & ~rejected[rows][:, :width]
            removed[update, 0] += float(before.sum() - after.sum())
            removed[update, 1] += float(((before.sum(-1) > 0) & ~after.any(-1)).sum())
            mb.response_mask = after.to(before.dtype)
    if dp_group is not None:
        dist.all_reduce(removed, group=dp_group)
    return replace(
        totals,
        update_tokens=totals.update_tokens - removed[:, 0].to(totals.update_tokens.dtype),
        update_sequences=totals.update_sequences - removed[:, 1].to(totals.update_sequences.dtype),
    )
