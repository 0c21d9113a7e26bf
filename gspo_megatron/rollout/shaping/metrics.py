"""Diagnostics logged for every shaper, and their reduction over a batch of groups.

Design decisions:
- The same metrics are computed whatever shaper runs (``shaping.metrics``, the steps and segments by
  ``shaping.trigger_words``), so a
  baseline and a shaped run are compared on one scale: keyword steps per response, keyword segments
  per length cluster, tokens per response, accuracy, format rate, raw vs shaped reward mean.
- Metrics stay tensors. A per-response metric has leading dimension G ([G] or [G, K]); a per-group
  scalar is 0-dim. The batch reduction pools per-response values over all responses (so groups of
  different sizes weigh by response count) and averages per-group scalars with nanmean (a group
  without a correct response reports NaN for quantities that need one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gspo_megatron.rollout.shaping.config import ShapingConfig
from gspo_megatron.rollout.shaping.segmentation import keyword_segment_counts
from gspo_megatron.rollout.shaping.types import ShapingGroup


def group_metrics(group: ShapingGroup, shaped_rewards: torch.Tensor, cfg: ShapingConfig) -> dict[str, torch.Tensor]:
    raw = group.rewards.float()
    segments_per_cluster = keyword_segment_counts(
        group.response_texts,
        group.response_lengths.tolist(),
        cfg.trigger_words,
        cfg.metrics.bucket_edges,
        cfg.trigger_case_sensitive,
    )
    return {
        "steps_per_response": group.steps.float(),
        "segments_per_cluster": segments_per_cluster,
        "tokens_per_response": group.response_lengths.float(),
        "accuracy": group.correct.float().mean(),
        "format_rate": group.format_ok.float().mean(),
        "raw_reward_mean": raw.mean(),
        "shaped_reward_mean": shaped_rewards.float().mean(),
        "shaping_delta_mean": (shaped_rewards.float() - raw).mean(),
    }


def reduce_metrics(per_group: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch metrics: per-response values pooled and averaged over dim 0; scalars nan-averaged."""
    reduced: dict[str, torch.Tensor] = {}
    keys = {key for metrics in per_group for key in metrics}
    for key in sorted(keys):
        values = [metrics[key] for metrics in per_group if key in metrics]
        if values[0].dim() == 0:
            reduced[key] = torch.stack([v.float() for v in values]).nanmean()
        else:
            reduced[key] = torch.cat([v.float() for v in values]).nanmean(dim=0)
    return reduced
