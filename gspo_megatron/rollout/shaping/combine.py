"""Where the shaping enters the advantage: into the reward (before normalisation) or after it.

Group-relative advantages divide by the group's reward std:  A_i = (r_i - mean r) / (std r + eps).
Shaping a reward by a penalty scaled by lambda (GRSP) or beta (Step-GRPO) therefore loses its scale
wherever the penalty is the group's only variation -- a group in which EVERY response is correct,
exactly where length shaping should act: there (lambda * P_i - mean) / std(lambda * P) = P_i / std P
whatever lambda is (measured: +-1.16 for lambda = 0.001, 0.1 and 1). The literature's two ways out,
both configurable:

- ``algorithm.advantage.normalize_std=false`` (Dr. GRPO, arXiv 2503.20783): A_i = r_i - mean r, so the shaped
  reward's scale is kept everywhere (and the task reward's scale with it).
- ``shaping.combine=advantage``: normalise the TASK reward, then add the centred shaping term,
      A_i = (r_i - mean r) / (std r + eps) + (d_i - mean d),   d_i = shaped_i - r_i,
  as length-penalty methods that add their term to the normalised advantage do. In an all-correct
  group A_i = d_i - mean d, proportional to lambda; in a mixed group the correctness signal keeps its
  unit scale and the shaping re-ranks within it.
``shaping.combine=reward`` (the papers' formulation) shapes the reward before the estimator.

Design decision: ``advantage`` is the DEFAULT. Length shaping exists to act where every response is
correct; under ``reward`` its coefficient (GRSP's lambda, Step-GRPO's beta) is invisible there (beta =
0.05 and 0.5 gave identical advantages), so the knob a user tunes would do nothing where it matters.
Under ``advantage`` the advantage of an all-correct group is proportional to the coefficient, and a
mixed group keeps its unit-scale correctness signal. ``advantage/zero_variance_group_frac`` then
counts groups whose FINAL advantages are all equal (no learning signal), not groups whose task reward
is constant (under ``advantage`` those still carry the shaping term).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gspo_megatron.algorithms.advantages import AdvantageOutput
from gspo_megatron.rollout.shaping.config import ShapingCombine

SHAPING_COMBINES = tuple(ShapingCombine)


def shaped_advantages(
    rewards: torch.Tensor,
    shaped_rewards: torch.Tensor,
    estimate: Callable[[torch.Tensor], AdvantageOutput],
    group_size: int,
    combine: str,
) -> AdvantageOutput:
    """Advantages [N] from raw and shaped rewards [N] (groups of ``group_size`` contiguous)."""
    if combine == ShapingCombine.reward:
        return estimate(shaped_rewards)
    if combine != ShapingCombine.advantage:
        raise ValueError(f"shaping.combine must be one of {SHAPING_COMBINES}, got {combine!r}")
    out = estimate(rewards)
    delta = (shaped_rewards.float() - rewards.float()).view(-1, group_size)
    centred = (delta - delta.mean(dim=1, keepdim=True)).reshape(-1)
    advantages = out.advantages + centred
    groups = advantages.view(-1, group_size)
    zero_variance = groups.amax(dim=1) == groups.amin(dim=1)  # no signal left in the group
    return AdvantageOutput(
        advantages,
        {
            **out.stats,
            "zero_variance_group_frac": zero_variance.float().mean(),
            "advantage_abs_mean": advantages.abs().mean(),
        },
    )
