"""``AlgorithmConfig``: which policy loss and advantage estimator to use, with what constants.

Design decisions:
- Variants are config values, not flags: ``loss`` names an entry of ``POLICY_LOSSES`` and
  ``advantage_estimator`` one of ``ADVANTAGE_ESTIMATORS``; validation checks both against the
  registries, so a new loss needs no change here.
- Defaults are GSPO's (arXiv 2507.18071: eps_low 3e-4, eps_high 4e-4, sequence-mean aggregation).
  GRPO's usual values (0.2 / 0.28, DAPO clip-higher) live in ``conf/algorithm/grpo.yaml``;
  ``RECOMMENDED_CLIP`` records both so tools can warn about a mismatched pair.
- ``validate_algorithm_config`` is called once, early (the lead's config validation calls it); it
  raises ``ValueError`` naming the field and the fix.
- ``make_loss_context`` is the one place a ``LossContext`` is built from config plus the per-step
  denominators, so the trainer never copies fields by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from gspo_megatron.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageContext
from gspo_megatron.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    SEQUENCE_LEVEL_AGGREGATIONS,
    Count,
    LossContext,
)
from gspo_megatron.algorithms.reductions import local_sequence_sum

# (clip_low, clip_high) from the papers: GSPO arXiv 2507.18071; GRPO with DAPO's clip-higher.
RECOMMENDED_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.28)}
_SEQUENCE_LEVEL_LOSSES = ("gspo", "gspo_token")
# Where pi_old comes from. ``rollout``: the engine's sampling log-probs (GSPO arXiv 2507.18071 §4.3:
# sequence-level likelihoods tolerate the engine/trainer precision gap) -- no old-log-prob forward.
OLD_LOG_PROB_SOURCES = ("trainer", "rollout")


@dataclass
class AlgorithmConfig:
    name: str = "gspo"  # a label for logs and run names
    loss: str = "gspo"  # a POLICY_LOSSES name
    clip_low: float = 3e-4  # ratio floor 1 - clip_low
    clip_high: float = 4e-4  # ratio ceiling 1 + clip_high
    aggregation: str = "seq_mean_token_mean"
    log_ratio_clamp: float = 20.0  # |log ratio| bound applied before exp
    advantage_estimator: str = "group_relative"  # an ADVANTAGE_ESTIMATORS name
    normalize_std: bool = True  # divide advantages by the group's reward std (False: Dr.GRPO)
    advantage_eps: float = 1e-6
    logprob_chunk_size: Optional[int] = None  # tokens per chunk in vocab_parallel_log_probs; None: one
    routing_replay: str = "none"  # none | old_policy | rollout (R3); see gspo_megatron/routing/replay.py
    old_log_probs: str = "trainer"  # pi_old from: trainer (a forward pass) | rollout (the engine's log-probs)


def validate_algorithm_config(cfg: AlgorithmConfig) -> None:
    """Raise ``ValueError`` naming the first inconsistent field of ``cfg`` and how to fix it."""
    if cfg.loss not in POLICY_LOSSES:
        raise ValueError(f"algorithm.loss={cfg.loss!r} is not a policy loss; valid: {', '.join(POLICY_LOSSES.names())}")
    if cfg.advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm.advantage_estimator={cfg.advantage_estimator!r} is unknown; valid: "
            f"{', '.join(ADVANTAGE_ESTIMATORS.names())}"
        )
    if cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"algorithm.aggregation={cfg.aggregation!r} is unknown; valid: {', '.join(AGGREGATIONS)}")
    if cfg.loss in _SEQUENCE_LEVEL_LOSSES and cfg.aggregation not in SEQUENCE_LEVEL_AGGREGATIONS:
        raise ValueError(
            f"algorithm.loss={cfg.loss!r} with aggregation={cfg.aggregation!r}: GSPO's ratio is already "
            f"length-normalised per sequence, so token-weighted aggregation re-introduces length bias; "
            f"set algorithm.aggregation=seq_mean_token_mean"
        )
    if not 0 <= cfg.clip_low < 1:
        raise ValueError(f"algorithm.clip_low must be in [0, 1), got {cfg.clip_low}")
    if cfg.clip_high < 0:
        raise ValueError(f"algorithm.clip_high must be >= 0, got {cfg.clip_high}")
    if cfg.log_ratio_clamp <= 0:
        raise ValueError(f"algorithm.log_ratio_clamp must be > 0, got {cfg.log_ratio_clamp}")
    if cfg.advantage_eps < 0:
        raise ValueError(f"algorithm.advantage_eps must be >= 0, got {cfg.advantage_eps}")
    if cfg.old_log_probs not in OLD_LOG_PROB_SOURCES:
        raise ValueError(
            f"algorithm.old_log_probs={cfg.old_log_probs!r} is unknown; "
            f"valid: {', '.join(OLD_LOG_PROB_SOURCES)}"
        )
    if cfg.old_log_probs == "rollout" and cfg.routing_replay == "old_policy":
        raise ValueError(
            "algorithm.old_log_probs=rollout skips the trainer's old-policy forward, but "
            "routing_replay=old_policy replays the routing recorded in exactly that forward; use "
            "routing_replay=rollout (R3: the engine's routing, which produced the engine's log-probs) "
            "or none, or set algorithm.old_log_probs=trainer"
        )
    if cfg.logprob_chunk_size is not None and cfg.logprob_chunk_size < 1:
        raise ValueError(f"algorithm.logprob_chunk_size must be >= 1 or null, got {cfg.logprob_chunk_size}")


def make_loss_context(
    cfg: AlgorithmConfig,
    *,
    global_num_sequences: Count = None,
    global_num_tokens: Count = None,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] = local_sequence_sum,
) -> LossContext:
    """The ``LossContext`` for one micro-batch: config constants plus whole-batch denominators."""
    return LossContext(
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        aggregation=cfg.aggregation,
        global_num_sequences=global_num_sequences,
        global_num_tokens=global_num_tokens,
        log_ratio_clamp=cfg.log_ratio_clamp,
        sequence_sum=sequence_sum,
    )


def make_advantage_context(cfg: AlgorithmConfig, group_size: int) -> AdvantageContext:
    return AdvantageContext(group_size=group_size, normalize_std=cfg.normalize_std, eps=cfg.advantage_eps)
