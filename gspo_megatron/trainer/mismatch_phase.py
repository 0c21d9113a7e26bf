"""Apply the train/inference mismatch correction to a step's micro-batches (after old log-probs).

The weights are computed once from the whole batch (identical on every rank) and folded into each
micro-batch's advantages; see ``algorithms/mismatch_correction.py`` for the math.
"""

from __future__ import annotations

from gspo_megatron.algorithms.config import AlgorithmConfig
from gspo_megatron.algorithms.mismatch_correction import mismatch_weights, weighted_advantages
from gspo_megatron.models.micro_batch import MicroBatch
from gspo_megatron.trainer.batch import RolloutBatch


def correct_mismatch(
    batch: RolloutBatch, parts: list[list[MicroBatch]], algorithm: AlgorithmConfig
) -> dict[str, float]:
    """Re-weight the advantages of every micro-batch in ``parts``; returns the weights' metrics."""
    if batch.old_log_probs is None:
        raise RuntimeError("mismatch correction needs the old log-probs: run the old-log-prob pass first")
    weights, metrics = mismatch_weights(
        batch.old_log_probs,
        batch.rollout_log_probs,
        batch.response_mask,
        algorithm.mismatch_correction,
        algorithm.mismatch_cap,
        algorithm.log_ratio_clamp,
    )
    for mb in (mb for part in parts for mb in part):
        # token-budget micro-batches hold any rows, cut to their own width
        rows, width = mb.rows, mb.seq_len
        advantages, row_weights = batch.advantages[rows], weights[rows]
        advantages = advantages[:, :width] if advantages.dim() > 1 else advantages
        row_weights = row_weights[:, :width] if row_weights.dim() > 1 else row_weights
        mb.advantages = weighted_advantages(advantages, row_weights)
    return {key: float(value) for key, value in metrics.items()}
