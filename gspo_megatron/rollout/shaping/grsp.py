"""GRSP segment penalty -- a RECONSTRUCTION of arXiv 2510.09535 (its exact constants were not
available; every constant here is a configurable guess).

    1. cut each response into segments (keyword triggers, or confidence minima of the rollout
       log-probs; see rollout/shaping/segmentation.py), lengths in tokens
    2. bucket segments into K length clusters by ``bucket_edges``; c_{i,k} = segments of response i
       in cluster k
    3. z-score each cluster's counts within the group:  z_{i,k} = (c_{i,k} - mean_j c_{j,k}) / std_j c_{j,k}
       (population std over the responses being scored; std = 0 -> z = 0)
    4. P_i = sum_k w_k z_{i,k}; descending weights (short-segment clusters weigh most) by default;
       the paper's "ascending weights collapse accuracy" was not reproduced in study E4
       (reports/e4_shaping: no collapse in 12 runs on two warm starts, accuracy within the noise floor)
    5. shaped r_i = r_i - lambda * P_i, then the usual advantage estimator

Design decisions:
- ``apply_to="correct"`` (default): the z-scores are taken over the CORRECT responses only and only
  they are penalised. The penalty then ranks how efficiently a problem was solved, never trades
  correctness for structure, and an incorrect response cannot earn a bonus for its segment profile.
  With fewer than two correct responses every std is 0 and nothing changes. ``apply_to="all"``
  scores every response.
- z-scores sum to zero over the scored responses, so the penalty leaves their mean reward unchanged:
  it only re-ranks within the group. Its logged mean is therefore ~0 by construction; what shows it
  acting is ``grsp/abs_penalty`` (mean |P_i|) and ``grsp/penalty_count_corr/<k>`` (per length
  cluster, the correlation of P_i with that cluster's segment count over the scored responses).
"""

from __future__ import annotations

import torch

from gspo_megatron.rollout.shaping.config import ApplyTo, GRSPConfig, Segmentation
from gspo_megatron.rollout.shaping.registry import SHAPERS
from gspo_megatron.rollout.shaping.segmentation import (
    cluster_counts,
    confidence_segment_lengths,
    keyword_segment_lengths,
)
from gspo_megatron.rollout.shaping.types import ShapedRewards, ShapingGroup


def masked_group_zscore(counts: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """float [G, K]: per-column z-scores over the rows where ``scored`` (bool [G]); other rows 0."""
    weight = scored.float().unsqueeze(1)  # [G, 1]
    n = weight.sum().clamp_min(1.0)
    mean = (counts * weight).sum(0) / n
    std = (((counts - mean) ** 2) * weight).sum(0).div(n).sqrt()
    safe_std = torch.where(std > 1e-8, std, torch.ones_like(std))
    z = torch.where(std > 1e-8, (counts - mean) / safe_std, torch.zeros_like(counts))
    return z * weight


def grsp_penalty(counts: torch.Tensor, scored: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float [G]: P_i = sum_k w_k z_{i,k}."""
    if weights.numel() != counts.shape[1]:
        raise ValueError(f"{weights.numel()} cluster weights for {counts.shape[1]} length clusters")
    return masked_group_zscore(counts, scored) @ weights.float()


def segment_lengths(group: ShapingGroup, cfg: GRSPConfig) -> list[torch.Tensor]:
    """Per response, float [S_i] segment lengths in tokens, by the configured segmentation."""
    if cfg.segmentation == Segmentation.keyword:
        return [
            keyword_segment_lengths(text, int(n), cfg.keywords, cfg.case_sensitive)
            for text, n in zip(group.response_texts, group.response_lengths.tolist(), strict=True)
        ]
    if group.token_log_probs is None:
        raise ValueError(
            "GRSP confidence segmentation needs ShapingGroup.token_log_probs (the rollout log-probs); "
            "pass them, or set shaping.grsp.segmentation=keyword"
        )
    return [
        confidence_segment_lengths(lp, cfg.confidence_window, cfg.confidence_threshold) for lp in group.token_log_probs
    ]


@SHAPERS.register("grsp")
def grsp(group: ShapingGroup, cfg: GRSPConfig) -> ShapedRewards:
    counts = cluster_counts(segment_lengths(group, cfg), cfg.bucket_edges)
    scored = group.correct if cfg.apply_to == ApplyTo.correct else torch.ones_like(group.correct)
    penalty = grsp_penalty(counts, scored, torch.tensor(cfg.resolved_weights()))
    return ShapedRewards(
        rewards=group.rewards.float() - cfg.penalty_coef * penalty,
        metrics={
            "segments_per_cluster": counts,
            "penalty": penalty,  # sums to 0 over the scored responses: its mean shows nothing
            "abs_penalty": penalty.abs(),  # how hard it acts: mean |P_i| over the responses
            "penalty_count_corr": penalty_count_correlation(counts, scored, penalty).unsqueeze(0),
        },
    )


def penalty_count_correlation(counts: torch.Tensor, scored: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """float [K]: Pearson correlation, over the scored responses, of P_i with each cluster's segment
    count c_{i,k} -- positive where more segments of that length cost reward; NaN where undefined
    (fewer than two scored responses, or a constant column)."""
    rows = scored.bool()
    if int(rows.sum()) < 2:
        return torch.full((counts.shape[1],), float("nan"))
    c = counts[rows].float() - counts[rows].float().mean(0)
    p = penalty[rows].float() - penalty[rows].float().mean()
    denominator = c.pow(2).sum(0).sqrt() * p.pow(2).sum().sqrt()
    return torch.where(denominator > 1e-12, (c * p.unsqueeze(1)).sum(0) / denominator.clamp_min(1e-12), float("nan"))
