"""The one call site of the reward shapers: shape each prompt's group, then reduce the metrics.

Design decisions:
- The shaper is looked up by name in the registry; there is no per-shaper branching here.
- Shaping happens between reward computation and the advantage estimator and only changes rewards,
  so it composes with every policy loss.
- Shaper-specific metrics are namespaced by the shaper (``step_grpo/steps``); the shared diagnostics
  (``steps_per_response``, ...) are not, so they line up across runs with different shapers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gspo_megatron.rollout.shaping.config import ShapingConfig
from gspo_megatron.rollout.shaping.metrics import group_metrics, reduce_metrics
from gspo_megatron.rollout.shaping.registry import SHAPERS
from gspo_megatron.rollout.shaping.types import ShapedRewards, ShapingGroup


@dataclass
class ShapedBatch:
    groups: list[ShapedRewards]  # one per prompt, in input order, each with its group's metrics
    metrics: dict[str, torch.Tensor]  # batch-level reduction of the groups' metrics

    def rewards(self) -> torch.Tensor:
        """float [B, G] (all groups must have the same size G)."""
        sizes = {g.rewards.numel() for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"groups have different sizes {sorted(sizes)}; use .groups[i].rewards")
        return torch.stack([g.rewards for g in self.groups])


def shape_group(group: ShapingGroup, cfg: ShapingConfig) -> ShapedRewards:
    shaper = SHAPERS.get(cfg.name)
    shaped = shaper(group, cfg.shaper_config())
    if shaped.rewards.shape != group.rewards.shape:
        raise ValueError(
            f"shaper {cfg.name!r} returned rewards of shape {tuple(shaped.rewards.shape)}, expected "
            f"{tuple(group.rewards.shape)} (one per response)"
        )
    metrics = group_metrics(group, shaped.rewards, cfg)
    metrics.update({f"{cfg.name}/{key}": value for key, value in shaped.metrics.items()})
    return ShapedRewards(rewards=shaped.rewards, metrics=metrics)


def shape_batch(groups: Sequence[ShapingGroup], cfg: ShapingConfig) -> ShapedBatch:
    if not groups:
        raise ValueError("shape_batch needs at least one group")
    shaped = [shape_group(group, cfg) for group in groups]
    return ShapedBatch(groups=shaped, metrics=reduce_metrics([s.metrics for s in shaped]))
