"""pi_old from the rollout engine (``algorithm.old_log_probs=rollout``): no old-log-prob forward.

The engine reports log_softmax(logits / T) of every sampled token (before top-k/top-p filtering,
``rollout/sampling.py``; SGLang alike, ``rollout/sglang/protocol.py``) -- the quantity the trainer's
``LogProbHead`` would recompute. The GSPO paper (arXiv 2507.18071, §4.3) argues the sequence-level
ratio tolerates the engine/trainer precision gap, so these serve as pi_old directly:

    ratio_i = exp( (1/|y_i|) * sum_t [log pi_theta(y_it) - log pi_engine(y_it)] )

Consequences, each handled where it arises:
- no train/inference mismatch metric (it would compare a tensor with itself) and no old entropy;
- no old-policy routing recording: ``routing_replay=old_policy`` is refused at start-up
  (``algorithms/config.py``); R3 replays the engine's routing and needs no recording; the routing
  diagnostics take the old policy's routing from the first update's training forward instead
  (before the first optimizer step the policy *is* the old policy; ``trainer/diagnostics.py``).
"""

from __future__ import annotations

from gspo_megatron.models.micro_batch import MicroBatch
from gspo_megatron.trainer.batch import RolloutBatch


def use_engine_log_probs(batch: RolloutBatch, micro_batches: list[MicroBatch]) -> dict[str, float]:
    """Set ``old_log_probs`` of the batch and of every micro-batch to the engine's log-probs."""
    batch.old_log_probs = batch.rollout_log_probs
    for mb in micro_batches:
        mb.old_log_probs = mb.rollout_log_probs
    return {}
