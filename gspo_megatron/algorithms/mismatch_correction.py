"""Train/inference mismatch correction: truncated or masked importance weights pi_old / pi_rollout.

The engine samples from pi_rollout (its kernels, precision, routing), the trainer's pi_old scores the
same tokens slightly differently; the policy gradient is estimated off-policy by that gap. The
correction re-weights each token (or sequence) by the importance ratio, capped at C
(Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025: TIS;
verl ``rollout_is``, TRL ``vllm_importance_sampling_*``, slime ``--use-tis``):

    token_truncate     w_{i,t} = min(rho_{i,t}, C),          rho_{i,t} = pi_old(y_{i,t}) / pi_rollout(y_{i,t})
    token_mask         w_{i,t} = rho_{i,t} if L <= rho_{i,t} <= C else 0   (L = ``mismatch_lower``, default 0;
                       slime's IcePop, ``loss.py:icepop_function``: ``--tis-clip`` C = 2, ``--tis-clip-low`` L = 0)
    sequence_truncate  w_i = min(rho_i, C),  rho_i = exp( (1/|y_i|) sum_t log rho_{i,t} )  (geometric: GSPO's
    sequence_mask      w_i = rho_i if L <= rho_i <= C else 0                         length-normalised form)
                       or, with ``sequence_ratio=product``, rho_i = exp( sum_t log rho_{i,t} ) (verl, TRL)
    decoupled          AReaL's decoupled PPO (below): token_mask's weights, and for a loss with one ratio per
                       sequence (gspo) their mean over the row, w_i = (1/|y_i|) sum_t w_{i,t}

The decoupled objective (AReaL, Fu et al., arXiv 2505.24298; inclusionAI/AReaL 61d1bbb,
``areal/utils/functional/functional.py:144-221``, ``ppo_actor_loss_fn`` with ``behav_imp_weight_cap``). Three
policies: the behaviour policy mu that sampled a token (the engine at that token's weight version v_t: a token
of a carried or asynchronous sample may come from an older version than its neighbours), the proximal policy
pi_prox (here pi_old: the trainer's pass before this step's updates, ``trainer.old_log_probs=trainer``, one
version for every token), and pi_theta being trained. The clip is around pi_prox; the behaviour -> proximal
weight multiplies the clipped term:

    w_{i,t} = pi_prox(y_{i,t}) / mu_{v_t}(y_{i,t})  if L <= it <= C, else 0      (functional.py:208-216; AReaL
                                                                                 masks beyond its cap, C = 5)
    GRPO / GSPO-token:  J = agg_{i,t} w_{i,t} min(r_{i,t} A, clip(r_{i,t}) A),  r_{i,t} = pi_theta / pi_prox
    GSPO:               J = (1/N_seq) sum_i w_i min(s_i A_i, clip(s_i) A_i),   w_i = (1/|y_i|) sum_t w_{i,t}
                        s_i = exp( (1/|y_i|) sum_t [log pi_theta(y_{i,t}) - log pi_prox(y_{i,t})] )
                        -- every factor of s_i is pi_theta over pi_prox, never over a behaviour version; the
                        behaviour policies enter only through w. AReaL's GSPO multiplies the sequence term,
                        broadcast to each token, by that token's w_{i,t} and sums over the tokens
                        (functional.py:176-181 and 217), which is the sequence term times sum_t w_{i,t}: with
                        GSPO's per-sequence mean, w_i above.
With every token sampled by the trained version and mu = pi_prox, each w is exactly 1 and J is the loss
without correction. Masked tokens stay in the denominators (AReaL's ``loss_mask_count``, functional.py:174).

Design decisions:
- The weight multiplies the advantage: with w >= 0, min(r w A, clip(r) w A) = w min(r A, clip(r) A),
  so every policy loss is weighted exactly without a new loss signature; the clip indicators keep
  their sign (A w and A agree) except where w = 0, where nothing is clipped or learned. Weights are
  constants (no gradient). By default (``rejected=keep``) the loss denominators are unchanged (a
  masked token still counts, as in TRL and slime), so masking lowers the step's weight rather than
  re-normalising it; ``rejected=drop`` takes masked tokens out of the response mask and so out of
  the denominators (verl ``rollout_rs``), which ``rejected_mask`` returns for the trainer to apply.
- Token-level weights give per-token advantages, which ``gspo`` (one ratio per sequence) cannot use:
  pair token modes with ``grpo`` or ``gspo_token``, sequence modes with any loss. ``decoupled`` gives
  ``gspo`` its row mean (``per_row``), AReaL's GSPO weighting, so it pairs with every loss.
- ``decoupled`` is a value of the one correction key, not a flag beside it: its weight is the same ratio
  pi_old / pi_rollout that TIS/MIS/IcePop cap, so a second weight on top would count the ratio twice. It
  composes with ``lower`` (IcePop's band), rejection (``reject``, ``veto``) and OPSM (``loss.opsm_delta``);
  ``rejected=drop`` is refused with it (AReaL keeps masked tokens in the denominators; token_mask drops).
- log rho is clamped to +-``clamp`` before exp (as the losses clamp their log-ratios).
- Metrics: the weights' mean / min / max over valid tokens (token modes, decoupled) or sequences
  (sequence modes), the fraction truncated or masked, and the mean raw ratio rho before the cap.
"""

from __future__ import annotations

import torch

from gspo_megatron.algorithms.metrics import COUNT, extremum_entries, finalize_metrics, mean_entries
from gspo_megatron.core.config_node import ConfigChoice


class MismatchCorrection(ConfigChoice):
    """``algorithm.mismatch.correction`` (a closed choice: Hydra refuses other values at compose time):
    the level a weight is formed at (per token or per sequence) and what it does beyond the cap
    (truncate, or mask), as properties, so no caller reads them out of the name."""

    none = "none"
    token_truncate = "token_truncate"
    token_mask = "token_mask"
    sequence_truncate = "sequence_truncate"
    sequence_mask = "sequence_mask"
    decoupled = "decoupled"  # AReaL's decoupled PPO: token_mask's weights, their row mean for gspo

    @property
    def per_token(self) -> bool:
        """One weight per token ([B, T]) whatever the loss; else one per sequence ([B]) or, decoupled,
        per token or per row as the loss takes its advantages."""
        return self in (MismatchCorrection.token_truncate, MismatchCorrection.token_mask)

    @property
    def per_sequence(self) -> bool:
        return self in (MismatchCorrection.sequence_truncate, MismatchCorrection.sequence_mask)

    @property
    def masks(self) -> bool:
        """Beyond the band a weight is 0 (the token or row is rejected); else the weight is capped."""
        return self in (MismatchCorrection.token_mask, MismatchCorrection.sequence_mask, MismatchCorrection.decoupled)


MISMATCH_MODES = tuple(MismatchCorrection)


class SequenceRatio(ConfigChoice):
    """``algorithm.mismatch.sequence_ratio``: how the sequence modes combine a row's token ratios."""

    geometric = "geometric"  # rho_i = exp( (1/|y_i|) sum_t log rho_{i,t} ): length-normalised, GSPO's form
    product = "product"  # rho_i = exp( sum_t log rho_{i,t} ): verl rollout_is=sequence, TRL sequence_*


class RejectedTokens(ConfigChoice):
    """``algorithm.mismatch.rejected``: what a mask mode does with the tokens (rows) it zeroes."""

    keep = "keep"  # weight 0, still counted in the loss denominators (TRL, slime icepop)
    drop = "drop"  # removed from the response mask, so from the denominators too (verl rollout_rs)


def mismatch_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    cap: float,
    clamp: float = 20.0,
    sequence_ratio: str = SequenceRatio.geometric,
    lower: float = 0.0,
    per_row: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights ([B, T] for token modes, 0 off the mask; [B] for sequence modes) and metrics."""
    weights, stats = mismatch_weight_stats(
        old_log_probs, rollout_log_probs, response_mask, mode, cap, clamp, sequence_ratio, lower, per_row
    )
    return weights, finalize_mismatch_weight_stats(stats)


def mismatch_weight_stats(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    cap: float,
    clamp: float = 20.0,
    sequence_ratio: str = SequenceRatio.geometric,
    lower: float = 0.0,
    per_row: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``mismatch_weights`` with its metrics as additive entries (``algorithms/metrics.py``: sums,
    counts, mins, maxes), so rows held by different data-parallel ranks reduce exactly.

    ``per_row`` (``decoupled`` only; the loss takes one advantage per row, ``PER_ROW_ADVANTAGE_LOSSES``): the
    token weights' mean over each row's valid tokens, [B]; the metrics stay per token."""
    if mode not in MISMATCH_MODES or mode == MismatchCorrection.none:
        raise ValueError(
            f"mismatch correction mode {mode!r} is not a correction; valid: {', '.join(MISMATCH_MODES[1:])}"
        )
    correction = MismatchCorrection(mode)
    if not cap >= 1.0:
        raise ValueError(f"the importance-weight cap must be >= 1, got {cap}")
    mask = response_mask.bool()
    log_rho = torch.where(mask, old_log_probs.double() - rollout_log_probs.double(), 0.0)
    action = "mask" if correction.masks else "truncate"
    if correction.per_token or correction == MismatchCorrection.decoupled:
        select = mask
    else:
        lengths = mask.sum(-1)
        log_rho = log_rho.sum(-1)  # sum_t log rho_{i,t}: the product's log
        if sequence_ratio == SequenceRatio.geometric:
            log_rho = log_rho / lengths.clamp_min(1)  # (1/|y_i|) sum_t log rho_{i,t}
        select = lengths > 0
    rho = log_rho.clamp(-clamp, clamp).exp()
    beyond = (rho > cap) | (rho < lower) if action == "mask" else rho > cap
    weights = rho.clamp(max=cap) if action == "truncate" else torch.where(beyond, 0.0, rho)
    weights = torch.where(select, weights, 0.0)
    count = select.sum().double()
    stats = {
        **mean_entries("weight_mean", weights.sum(), count),
        **extremum_entries("weight", weights, select),
        **mean_entries(_BEYOND[action], (beyond & select).sum().double(), count),
        **mean_entries("ratio_mean", torch.where(select, rho, 0.0).sum(), count),
    }
    if per_row and correction == MismatchCorrection.decoupled:
        weights = weights.sum(-1) / mask.sum(-1).clamp_min(1)  # w_i = (1/|y_i|) sum_t w_{i,t}
    return weights.float(), stats


_BEYOND = {"truncate": "truncated_frac", "mask": "masked_frac"}


def finalize_mismatch_weight_stats(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights' metrics from (reduced) additive entries: means, min and max (NaN with no rows)."""
    out = {f"mismatch_is/{k.replace('/', '_')}": v.float() for k, v in finalize_metrics(stats).items()}
    for name in ("weight_mean", *_BEYOND.values(), "ratio_mean"):
        key = f"mismatch_is/{name}"
        if key in out and float(stats[name + COUNT]) == 0:
            out[key] = torch.tensor(0.0)  # no weighted rows: the sums are 0 (as the cap's fraction)
    return out


def rejected_mask(weights: torch.Tensor, response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The response mask without the tokens a mask mode rejected ([B, T]; ``weights`` from
    ``mismatch_weights``): a rejected token (token_mask) or every token of a rejected row
    (sequence_mask) leaves it; other modes reject nothing."""
    mask = response_mask.bool()
    if not MismatchCorrection(mode).masks:
        return mask
    kept = weights > 0 if weights.dim() == 2 else (weights > 0).unsqueeze(-1)
    return mask & kept


def weighted_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A_i w_i, A_i w_{i,t}, A_{i,t} w_i or A_{i,t} w_{i,t}: advantages [B] or [B, T] times weights
    [B] (one per sequence) or [B, T]. A per-row operand is lined up on the row axis, never broadcast
    along T (which ``[B, T] * [B]`` does silently when B == T)."""
    if advantages.dim() == weights.dim():  # both per row or both per token
        return advantages * weights
    if advantages.dim() == 1:  # per-row advantages, per-token weights
        return advantages.unsqueeze(-1) * weights
    return advantages * weights.unsqueeze(-1)  # per-token advantages, per-row (sequence-mode) weights
