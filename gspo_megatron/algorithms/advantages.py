"""Advantage estimators behind a registry: ``estimator(rewards [N], ctx) -> AdvantageOutput``.

Design decisions:
- Rewards arrive flat, ``[N] = [num_prompts * G]``, with each prompt's G responses contiguous
  (``rewards.view(-1, G)`` is one group per row) -- the order the rollout layer produces with n = G.
- ``group_relative`` (shared by GRPO and GSPO, arXiv 2402.03300 / 2507.18071):
      A_i = (r_i - mean_j r_j) / (std_j r_j + eps)      (std optional; Dr.GRPO drops it)
  std is the unbiased sample std within the group (``torch.std``, correction 1; verl and TRL use the
  same), which needs G >= 2 when normalising.
- A group whose rewards are all equal has zero advantage for every member: it teaches nothing. Its
  fraction is returned as a statistic (exact equality of max and min, not a float tolerance) so the
  trainer can log it or filter such groups (DAPO's dynamic sampling).
- Statistics are 0-d tensors; no ``.item()``.
- Multi-turn trajectories may add a per-turn term (``turn_advantage_terms``): ragged (each trajectory has its
  own number of turns), so plain lists; the rollout side places it on each turn's generated tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gspo_megatron.core.registry import Registry


@dataclass(frozen=True)
class AdvantageContext:
    group_size: int  # G: responses per prompt, contiguous in the rewards vector
    normalize_std: bool = True
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.normalize_std and self.group_size < 2:
            raise ValueError(
                "normalize_std needs group_size >= 2 (the std of one sample is undefined); "
                "set normalize_std=false or sample more responses per prompt"
            )
        if self.eps < 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor  # [N] fp32, one per response
    stats: dict[str, torch.Tensor]  # 0-d tensors


ADVANTAGE_ESTIMATORS: Registry[Callable[[torch.Tensor, AdvantageContext], AdvantageOutput]] = Registry(
    "advantage estimator"
)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat [N] vector, got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}; every prompt must "
            f"have exactly group_size responses (contiguous)"
        )
    return rewards.detach().float().view(-1, group_size)


@ADVANTAGE_ESTIMATORS.register("group_relative")
def group_relative(rewards: torch.Tensor, ctx: AdvantageContext) -> AdvantageOutput:
    """A_i = (r_i - mean_group r) [/ (std_group r + eps)], with group statistics for logging."""
    groups = _grouped(rewards, ctx.group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if ctx.normalize_std:
        std = groups.std(dim=1, keepdim=True)
        # A zero-variance group is all zeros even with eps = 0 (0 / 0 would be NaN).
        advantages = torch.where(std > 0, centred / (std + ctx.eps), 0.0)
    else:
        advantages = centred
    zero_variance = groups.amax(dim=1) == groups.amin(dim=1)
    flat = groups.reshape(-1)
    stats = {
        "reward_mean": flat.mean(),
        "reward_std": flat.std() if flat.numel() > 1 else flat.new_zeros(()),
        "zero_variance_group_frac": zero_variance.float().mean(),
        "advantage_abs_mean": advantages.abs().mean(),
    }
    return AdvantageOutput(advantages.reshape(-1), stats)


def turn_advantage_terms(turn_rewards: Sequence[Sequence[float] | None], group_size: int) -> list[list[float]]:
    """The per-turn term of multi-turn trajectories' advantages: for trajectory i's turn t,

        u_{i,t} = r_{i,t} - mean_{j in group(i), j gave turn rewards, T_j > t} r_{j,t}

    (``turn_rewards[i]`` = (r_{i,0}, ..., r_{i,T_i-1}); None: trajectory i gave none, so it has no term -- an
    empty list -- and is in no turn's mean). Centred per group and turn index, as the group baseline centres
    the trajectory reward, so it moves no probability mass on average; not divided by a std: the caller's
    weight sets its scale (``algorithm.advantage.turn_reward_weight``). A turn only one trajectory of its
    group reached has term 0 (nothing to compare it with)."""
    if len(turn_rewards) % group_size:
        raise ValueError(f"{len(turn_rewards)} trajectories do not split into groups of {group_size}")
    terms: list[list[float]] = []
    for first in range(0, len(turn_rewards), group_size):
        group = turn_rewards[first : first + group_size]
        longest = max((len(r) for r in group if r is not None), default=0)
        baselines = []
        for turn in range(longest):
            reached = [r[turn] for r in group if r is not None and len(r) > turn]
            baselines.append(math.fsum(reached) / len(reached))
        terms.extend([] if r is None else [value - baselines[t] for t, value in enumerate(r)] for r in group)
    return terms
