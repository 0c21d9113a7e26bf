"""The ``none`` shaper: the verifier's reward, unchanged (the baseline every shaped run compares to)."""

from __future__ import annotations

from gspo_megatron.rollout.shaping.registry import SHAPERS
from gspo_megatron.rollout.shaping.types import ShapedRewards, ShapingGroup


@SHAPERS.register("none")
def no_shaping(group: ShapingGroup, cfg: object | None = None) -> ShapedRewards:
    return ShapedRewards(rewards=group.rewards.float().clone())
