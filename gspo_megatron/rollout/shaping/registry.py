"""The reward-shaper registry, on the project's shared ``Registry``.

Duplicate names are rejected at registration; an unknown name raises ``UnknownNameError`` listing
every registered shaper. Shaper modules register themselves on ``import gspo_megatron.rollout.shaping``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gspo_megatron.core.registry import Registry, UnknownNameError

# name -> shaper(group: ShapingGroup, cfg) -> ShapedRewards
SHAPERS: Registry[Callable[..., Any]] = Registry("reward shaper")

__all__ = ["SHAPERS", "Registry", "UnknownNameError"]
