"""Efficient-reasoning reward shapers: change rewards before the advantage estimator.

Registered shapers (``SHAPERS``): ``none``, ``step_grpo`` (Step-GRPO), ``grsp`` (GRSP,
reconstructed), ``dapo_overlong`` (DAPO soft overlong punishment), ``kimi_length`` (Kimi k1.5 length
reward). Call site: ``shape_batch(groups, ShapingConfig(name=...))``.
"""

from gspo_megatron.rollout.shaping.config import (
    DAPOOverlongConfig,
    GRSPConfig,
    KimiLengthConfig,
    ShapingConfig,
    ShapingMetricsConfig,
    StepGRPOConfig,
)
from gspo_megatron.rollout.shaping.registry import SHAPERS, UnknownNameError
from gspo_megatron.rollout.shaping.types import ShapedRewards, ShapingGroup, group_from_samples

# Importing the shaper modules registers them.
from gspo_megatron.rollout.shaping import grsp, identity, length, step_grpo  # noqa: F401  isort: skip
from gspo_megatron.rollout.shaping.apply import ShapedBatch, shape_batch, shape_group

__all__ = [
    "SHAPERS",
    "DAPOOverlongConfig",
    "GRSPConfig",
    "KimiLengthConfig",
    "ShapedBatch",
    "ShapedRewards",
    "ShapingConfig",
    "ShapingGroup",
    "ShapingMetricsConfig",
    "StepGRPOConfig",
    "UnknownNameError",
    "group_from_samples",
    "shape_batch",
    "shape_group",
]
