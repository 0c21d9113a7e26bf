"""Train/inference mismatch: how far the trainer's token log-probs are from the rollout engine's.

The same tokens scored by the trainer (Megatron, training numerics) and by the engine that sampled
them (SGLang kernels, other parallel layout, maybe other routing) differ; a growing gap biases
importance ratios (pi_theta / pi_old computed against engine log-probs) and is the first thing to
check when an MoE run drifts.

Design decisions:
- Returned as sums and counts (tensors, no ``.item()``), so micro-batches and data-parallel ranks
  add them up (one all-reduce) and the ratio is formed once per step with global denominators;
  ``finalize_mismatch`` does that division.
- "Large" means |delta| > ln 2: the two engines disagree on the token's probability by more than a
  factor of two.
"""

from __future__ import annotations

import math

import torch

LARGE_LOG_PROB_GAP = math.log(2.0)


def train_inference_mismatch(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-token |log p_train - log p_rollout| over ``mask``, as sums and counts (float64 scalars).

    Keys: ``abs_log_prob_diff_sum`` = sum_t m_t |delta_t|, ``large_diff_count`` = sum_t m_t [|delta_t| > ln 2],
    ``token_count`` = sum_t m_t. All inputs share one shape (e.g. [batch, response_len]).
    """
    if not (train_log_probs.shape == rollout_log_probs.shape == mask.shape):
        raise ValueError(
            f"shapes differ: train {tuple(train_log_probs.shape)}, rollout {tuple(rollout_log_probs.shape)}, "
            f"mask {tuple(mask.shape)}; pass per-token tensors aligned on the response tokens"
        )
    valid = mask.to(torch.float64)
    # delta_t = log p_train(y_t) - log p_rollout(y_t); masked positions may hold padding garbage, so
    # they are zeroed before the abs, not multiplied after (inf * 0 would be nan).
    delta = torch.where(mask.bool(), train_log_probs.double() - rollout_log_probs.double(), 0.0).abs()
    return {
        "abs_log_prob_diff_sum": delta.sum(),
        "large_diff_count": ((delta > LARGE_LOG_PROB_GAP).to(torch.float64) * valid).sum(),
        "token_count": valid.sum(),
    }


def finalize_mismatch(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mean |delta| per token and the fraction of tokens with |delta| > ln 2 (0 when no tokens)."""
    tokens = sums["token_count"].clamp(min=1.0)
    return {
        "mismatch/abs_log_prob_diff_mean": sums["abs_log_prob_diff_sum"] / tokens,
        "mismatch/large_diff_fraction": sums["large_diff_count"] / tokens,
    }
