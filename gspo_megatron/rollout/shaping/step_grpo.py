"""Step-GRPO reward: accuracy with a step-count efficiency term, plus a format term.

Step-GRPO (arXiv 2604.16890):
    k_i = 1 + number of standalone trigger words in response i        (see rollout/shaping/segmentation.py)
    mu  = mean of k_j over the group's CORRECT responses
    R_i = alpha * acc_i * (1 - beta * tanh((k_i - mu) / mu)) + (1 - alpha) * fmt_i

Design decisions:
- The shaped reward REPLACES the verifier's reward: it is built from ``correct`` (acc_i) and
  ``format_ok`` (fmt_i), as in the paper; ``group.rewards`` is only logged as the raw reward.
- Steps before a Dynamic Truncated Rollout exit: the text as it is, unless
  ``count_dropped_trigger`` adds the trigger a confident exit dropped (see StepGRPOConfig).
- The efficiency term exists only for correct responses and only when mu exists (at least one
  correct response). With none correct, R_i = (1 - alpha) * fmt_i. mu >= 1 because k_i >= 1, so
  the division is always safe.
- A correct response with fewer steps than its correct peers earns up to alpha*(1+beta); one with
  more earns down to alpha*(1-beta): tanh bounds the effect, and beta <= 1 keeps every correct
  response above every incorrect one with the same format.
"""

from __future__ import annotations

import torch

from gspo_megatron.rollout.shaping.config import StepGRPOConfig
from gspo_megatron.rollout.shaping.registry import SHAPERS
from gspo_megatron.rollout.shaping.types import ShapedRewards, ShapingGroup


def step_grpo_rewards(
    steps: torch.Tensor, correct: torch.Tensor, format_ok: torch.Tensor, alpha: float, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R [G], mu 0-dim; NaN when no response is correct) from step counts and outcome flags."""
    steps = steps.float()
    acc = correct.float()
    fmt = format_ok.float()
    num_correct = acc.sum()
    has_correct = num_correct > 0
    # mu = sum_{j correct} k_j / #correct; a placeholder of 1 keeps the unused branch finite.
    mu = torch.where(has_correct, (steps * acc).sum() / num_correct.clamp_min(1.0), torch.ones(()))
    efficiency = 1.0 - beta * torch.tanh((steps - mu) / mu)
    rewards = alpha * acc * efficiency + (1.0 - alpha) * fmt
    return rewards, torch.where(has_correct, mu, torch.full((), float("nan")))


@SHAPERS.register("step_grpo")
def step_grpo(group: ShapingGroup, cfg: StepGRPOConfig) -> ShapedRewards:
    steps = group.steps
    if cfg.count_dropped_trigger and group.dropped_triggers is not None:
        steps = steps + group.dropped_triggers.to(steps.dtype)  # the step a confident exit cut short
    rewards, mu = step_grpo_rewards(steps, group.correct, group.format_ok, cfg.alpha, cfg.beta)
    return ShapedRewards(
        rewards=rewards,
        metrics={"steps": steps.float(), "correct_steps_mean": mu},
    )
