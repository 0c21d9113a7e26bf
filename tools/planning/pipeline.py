"""What virtual pipeline stages change in a plan (the stages themselves: ``ParallelLayout``).

Design decisions:
- The layer split -- uneven end stages and virtual chunks -- is ``ParallelLayout``'s
  (``stage_layer_counts`` / ``stage_layers``), in megatron's own terms, so the planner and the trainer
  agree on which layers each rank holds; the trainer builds both (``policy/models/builder.py:build_model_chunks``).
- Interleaved 1F1B (Narayanan et al. 2021; megatron's ``theoretical_memory_usage.py``): the first
  stage keeps ``1 + (pp - 1) / (pp v)`` times the activations of plain 1F1B, and the bubble is
  ``(pp - 1) / v`` micro-batch slots instead of ``pp - 1``.
"""

from __future__ import annotations

from gspo_megatron.policy.parallel.layout import ParallelLayout


def in_flight_factor(layout: ParallelLayout) -> float:
    """Interleaved 1F1B keeps 1 + (pp - 1) / (pp v) times plain 1F1B's activations on the first stage."""
    return 1.0 if layout.vpp == 1 else 1 + (layout.pp - 1) / (layout.pp * layout.vpp)


def bubble_slots(layout: ParallelLayout) -> float:
    return (layout.pp - 1) / layout.vpp
