"""KL estimators between the policy and a frozen reference, per token, from sampled tokens.

With d = log pi_theta(y_t) - log pi_ref(y_t) at a sampled token (Schulman, "Approximating KL
divergence", 2020; the names verl's ``kl_loss_type`` and TRL's ``beta`` term use):
    k1 = d                                    verl "kl"/"k1"     unbiased, can be negative
    k2 = d^2 / 2                              verl "mse"/"k2"    >= 0, biased
    k3 = exp(-d) - 1 + d  (= r - 1 - log r,   verl "low_var_kl"/"k3", TRL's per-token KL
         r = pi_ref / pi_theta)                                   >= 0, unbiased, low variance
    low_var_kl = clamp( k3(clamp(d, -20, 20)), -10, 10 )   verl ``kl_penalty(..., "low_var_kl")`` and its
                                                   "k3" alias; slime ``compute_approx_kl(..., "low_var_kl")``
Gradients w.r.t. log pi_theta: 1, d and 1 - exp(-d) (0 where low_var_kl's bound of 10 is active).

What is clamped: every estimator sees d clamped to +-``clamp`` (``algorithm.loss.log_ratio_clamp``, 20 by
default) first, as the policy losses clamp their log-ratios, so a reference that assigns ~0
probability cannot overflow exp(-d); where that clamp is active the term has no gradient. k1 and k2
are otherwise unbounded (verl and slime clamp neither), and k3 is the unbounded form TRL uses
(``beta`` term): at d = -20 one token contributes k3 = e^20 - 21 = 4.85e8. ``low_var_kl`` adds
verl's own bounds -- d to [-20, 20] and the estimate to [-10, 10] -- so for d < -2.61 or
d > 11.0 a token contributes exactly 10 with no gradient, whatever ``clamp`` is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gspo_megatron.core.registry import Registry

KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.expm1(-log_ratio) + log_ratio  # exp(-d) - 1 + d, exact near d = 0


@KL_ESTIMATORS.register("low_var_kl")
def kl_low_var(log_ratio: torch.Tensor) -> torch.Tensor:
    bounded = log_ratio.clamp(-20.0, 20.0)  # verl's own bound on the log-ratio, before exp
    return (torch.expm1(-bounded) + bounded).clamp(-10.0, 10.0)  # k3, then verl's bound on the estimate


def reference_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str, clamp: float = 20.0
) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate [B, T]; gradient flows through ``log_probs`` only."""
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} differ")
    log_ratio = (log_probs - ref_log_probs.detach()).clamp(-clamp, clamp)
    return KL_ESTIMATORS.get(estimator)(log_ratio)
