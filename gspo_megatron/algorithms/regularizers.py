"""Terms added to the policy loss: an entropy bonus and a KL penalty toward a frozen reference.

    loss = policy_loss - entropy_coef * agg_t H_t + kl_coef * agg_t KL_t

``agg`` is the policy loss's own aggregation with its global denominators (``aggregate_tokens``), so
the added terms, like the policy loss, sum over micro-batches and ranks to the one-big-batch value
(verl aggregates its entropy and KL terms with the policy loss's ``loss_agg_mode`` likewise). The
entropy H_t is the full-vocabulary entropy of the sampling distribution from
``vocab_parallel_log_probs(..., entropy_grad=True)``; the KL estimators are in ``kl.py``.
The KL term also returns its token-mean value as a metric (the entropy is logged by the loss head).
"""

from __future__ import annotations

import torch

from gspo_megatron.algorithms.kl import reference_kl
from gspo_megatron.algorithms.losses import LossContext, aggregate_tokens
from gspo_megatron.algorithms.metrics import token_mean_metric


def entropy_bonus(entropy: torch.Tensor, response_mask: torch.Tensor, ctx: LossContext, coef: float) -> torch.Tensor:
    """-coef * agg_t H_t: minimising it raises the entropy (coef > 0)."""
    return -coef * aggregate_tokens(torch.where(response_mask.bool(), entropy, 0.0), response_mask, ctx)


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor,
    ctx: LossContext,
    coef: float,
    estimator: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(coef * agg KL_t, {"kl_ref": token mean of the estimate}); needs ``ref_log_probs`` when coef > 0."""
    if ref_log_probs is None:
        raise ValueError(
            "algorithm.kl.coef > 0 but the micro-batch has no ref_log_probs: the reference forward did "
            "not run (policy/reference.py adds them)"
        )
    mask = response_mask.bool()
    per_token = torch.where(mask, reference_kl(log_probs, ref_log_probs, estimator, ctx.loss.log_ratio_clamp), 0.0)
    term = coef * aggregate_tokens(per_token, response_mask, ctx)
    return term, token_mean_metric("kl_ref", per_token, mask, ctx.sequence_sum)
