"""Where the shaping enters the advantage: into the reward (before normalisation) or after it.

Group-relative advantages divide by the group's reward std:  A_i = (r_i - mean r) / (std r + eps).
Shaping a reward by a penalty scaled by lambda (GRSP) or beta (Step-GRPO) therefore loses its scale
wherever the penalty is the group's only variation -- a group in which EVERY response is correct,
exactly where length shaping should act: there (lambda * P_i - mean) / std(lambda * P) = P_i / std P
whatever lambda is (measured: +-1.16 for lambda = 0.001, 0.1 and 1). The literature's two ways out,
both configurable:

- ``algorithm.normalize_std=false`` (Dr. GRPO, arXiv 2503.20783): A_i = r_i - mean r, so the shaped
  reward's scale is kept everywhere (and the task reward's scale with it).
- ``shaping.combine=advantage``: normalise the TASK reward, then add the centred shaping term,
      A_i = (r_i - mean r) / (std r + eps) + (d_i - mean d),   d_i = shaped_i - r_i,
  as length-penalty methods that add their term to the normalised advantage do. In an all-correct
  group A_i = d_i - mean d, proportional to lambda; in a mixed group the correctness signal keeps its
  unit scale and the shaping re-ranks within it.
``shaping.combine=reward`` (default, the papers' formulation) shapes the reward before the estimator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gspo_megatron.algorithms.advantages import AdvantageOutput

SHAPING_COMBINES = ("reward", "advantage")


def shaped_advantages(
    rewards: torch.Tensor,
    shaped_rewards: torch.Tensor,
    estimate: Callable[[torch.Tensor], AdvantageOutput],
    group_size: int,
    combine: str,
) -> AdvantageOutput:
    """Advantages [N] from raw and shaped rewards [N] (groups of ``group_size`` contiguous)."""
    if combine == "reward":
        return estimate(shaped_rewards)
    if combine != "advantage":
        raise ValueError(f"shaping.combine must be one of {SHAPING_COMBINES}, got {combine!r}")
    out = estimate(rewards)
    delta = (shaped_rewards.float() - rewards.float()).view(-1, group_size)
    centred = (delta - delta.mean(dim=1, keepdim=True)).reshape(-1)
    return AdvantageOutput(out.advantages + centred, out.stats)
