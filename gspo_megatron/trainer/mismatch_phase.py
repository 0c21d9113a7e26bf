"""Apply the train/inference mismatch correction to a step's micro-batches (after old log-probs).

The weights are computed per row from the rows this rank holds and folded into each micro-batch's
advantages; their metrics are reduced over the data-parallel ranks. See
``algorithms/mismatch_correction.py`` for the math.
"""

from __future__ import annotations

from gspo_megatron.algorithms.config import AlgorithmConfig
from gspo_megatron.algorithms.mismatch_correction import (
    finalize_mismatch_weight_stats,
    mismatch_weight_stats,
    weighted_advantages,
)
from gspo_megatron.algorithms.reductions import all_reduce_metrics
from gspo_megatron.models.micro_batch import MicroBatch, required
from gspo_megatron.trainer.batch import RolloutBatch


def correct_mismatch(
    batch: RolloutBatch, parts: list[list[MicroBatch]], algorithm: AlgorithmConfig, dp_group=None
) -> dict[str, float]:
    """Re-weight the advantages of every micro-batch in ``parts``; returns the weights' metrics.

    ``batch`` holds this rank's rows; the metrics cover every data-parallel rank's rows when
    ``dp_group`` is given (sums and counts summed, extremes reduced over it)."""
    if batch.old_log_probs is None:
        raise RuntimeError("mismatch correction needs the old log-probs: run the old-log-prob pass first")
    weights, stats = mismatch_weight_stats(
        batch.old_log_probs,
        batch.rollout_log_probs,
        batch.mismatch_mask,
        algorithm.mismatch_correction,
        algorithm.mismatch_cap,
        algorithm.log_ratio_clamp,
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
    return {key: float(value) for key, value in finalize_mismatch_weight_stats(stats).items()}
