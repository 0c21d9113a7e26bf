"""Length-based shapers: DAPO's soft overlong punishment and Kimi k1.5's length reward.

DAPO (arXiv 2503.14476), added to the reward, L = response tokens:
    R_len(L) = 0                                 if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
             = -1                                 if L > L_max
Kimi k1.5 (arXiv 2501.12599), over the group's responses to one prompt:
    lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)
    R_len,i  = lambda_i if correct_i else min(0, lambda_i);   all lengths equal -> 0
    shaped   = r_i + weight * R_len,i

Design decisions:
- Both ADD to the verifier's reward (they compose with whatever the verifier scores).
- DAPO's L_max defaults to the rollout's max_response_length, so a response cut at the limit gets
  exactly -1 and the penalty is continuous across the soft zone.
- Kimi's incorrect responses are never rewarded for being short (min(0, lambda)), only penalised for
  being long; the paper's warm-up (length reward off early in training) is a schedule on ``weight``
  that the trainer owns.
"""

from __future__ import annotations

import torch

from gspo_megatron.rollout.shaping.config import DAPOOverlongConfig, KimiLengthConfig
from gspo_megatron.rollout.shaping.registry import SHAPERS
from gspo_megatron.rollout.shaping.types import ShapedRewards, ShapingGroup


def dapo_overlong_penalty(lengths: torch.Tensor, max_length: int, cache_length: int) -> torch.Tensor:
    """float [G], in [-1, 0]: DAPO's soft overlong punishment."""
    if not 1 <= cache_length <= max_length:
        raise ValueError(
            f"DAPO overlong punishment needs 1 <= cache_length <= max_length, got cache_length="
            f"{cache_length}, max_length={max_length}; set shaping.dapo_overlong.cache_length "
            f"(or max_length) to fit the rollout's max_response_length"
        )
    length = lengths.float()
    soft_start = float(max_length - cache_length)
    soft = (soft_start - length) / cache_length
    beyond = torch.where(length <= max_length, soft, -torch.ones_like(length))
    return torch.where(length <= soft_start, torch.zeros_like(length), beyond)


@SHAPERS.register("dapo_overlong")
def dapo_overlong(group: ShapingGroup, cfg: DAPOOverlongConfig) -> ShapedRewards:
    max_length = cfg.max_length if cfg.max_length is not None else group.max_response_length
    penalty = dapo_overlong_penalty(group.response_lengths, max_length, cfg.cache_length)
    return ShapedRewards(
        rewards=group.rewards.float() + penalty,
        metrics={"penalty": penalty, "penalized_fraction": (penalty < 0).float().mean()},
    )


def kimi_length_reward(lengths: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """float [G], in [-0.5, 0.5]: Kimi k1.5's group-relative length reward."""
    length = lengths.float()
    shortest, longest = length.min(), length.max()
    span = longest - shortest
    lam = torch.where(span > 0, 0.5 - (length - shortest) / span.clamp_min(1e-12), torch.zeros_like(length))
    return torch.where(correct, lam, lam.clamp(max=0.0))


@SHAPERS.register("kimi_length")
def kimi_length(group: ShapingGroup, cfg: KimiLengthConfig) -> ShapedRewards:
    length_reward = kimi_length_reward(group.response_lengths, group.correct)
    return ShapedRewards(
        rewards=group.rewards.float() + cfg.weight * length_reward,
        metrics={"length_reward": length_reward},
    )
