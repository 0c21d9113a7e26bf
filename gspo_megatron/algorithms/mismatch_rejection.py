"""Rejection sampling of off-policy samples: rows (or tokens) whose pi_old / pi_rollout leaves a band are taken
out of the loss, and a row with one catastrophic token is vetoed whole.

The anchors' formulas (each transcribed in tests/unit/algorithms/test_mismatch_rejection.py):

- verl ``rollout_rs`` (``docs/algo/rollout_corr.md``, ``verl/trainer/ppo/rollout_corr_helper.py``): with
  rho_{i,t} = pi_old(y_{i,t}) / pi_rollout(y_{i,t}) and the level's ratio

      token      r_{i,t} = rho_{i,t}
      sequence   r_i = exp( sum_t log rho_{i,t} )                       (verl ``seq_is_rs`` / ``seq_mis``)
      geometric  r_i = exp( (1/|y_i|) sum_t log rho_{i,t} )              (verl ``geo_rs``)

  each after the safety bound exp(clamp(log r, -20, 20)), a token (token level) or a whole row is kept exactly
  when  lower <= r <= upper;  ``lower`` defaults to 1 / upper (verl ``rollout_rs_threshold_lower``). verl's
  presets: ``seq_mis`` upper 2 (lower 0 in its single-threshold alias), ``geo_rs`` upper 1.001 / lower 0.999 with a
  veto of 1e-4.
- the veto (verl ``rollout_token_veto_threshold``, slime ``--mis-veto-threshold`` in
  ``examples/train_infer_mismatch_helper/mis.py:calculate_veto_mask``): a row is rejected when any of its valid
  tokens has rho_{i,t} < veto, on the unbounded ratio.

Design decisions:
- Rejected tokens leave the response mask, so they leave the loss denominators too (verl's
  ``modified_response_mask``); the weights of ``algorithms/mismatch_correction.py`` are independent and may be
  combined with any level (verl: "rejection sampling is independent of IS weighting").
- Rows only: each row's keep-mask needs only its own tokens, so every layout computes the same mask from the
  rows it holds; the metrics are additive entries reduced over data-parallel ranks.
- Metrics (``mismatch_rs/``): the fraction of units (tokens or rows) below and above the band, the fraction of
  rows vetoed and of tokens below the veto, and the fraction of valid tokens rejected in all.
"""

from __future__ import annotations

import math

import torch

from gspo_megatron.algorithms.metrics import finalize_metrics, mean_entries
from gspo_megatron.core.config_node import ConfigChoice


class RejectionLevel(ConfigChoice):
    """``algorithm.mismatch.reject``: which ratio the band [lower, upper] is applied to."""

    none = "none"
    token = "token"  # each token's rho_{i,t}
    sequence = "sequence"  # the row's product of ratios
    geometric = "geometric"  # the row's geometric mean of ratios


SAFETY_BOUND = 20.0  # |log r| bound before exp (verl, slime)


def rejection_lower(upper: float, lower: float | None) -> float:
    """The band's lower end: as given, else 1 / upper (verl ``rollout_rs_threshold_lower``)."""
    return 1.0 / upper if lower is None else lower


def rejection_keep_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None = None,
    veto: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The response mask less what the band and the veto reject ([B, T] bool) and additive metric entries."""
    mask = response_mask.bool()
    raw = torch.where(mask, old_log_probs.double() - rollout_log_probs.double(), 0.0)  # log rho_{i,t}
    keep = mask.clone()
    stats: dict[str, torch.Tensor] = {}
    if level != RejectionLevel.none:
        low = rejection_lower(upper, lower)
        if level == RejectionLevel.token:
            log_r, units = raw, mask
        else:
            lengths = mask.sum(-1)
            log_r = raw.sum(-1)  # sum_t log rho_{i,t}
            if level == RejectionLevel.geometric:
                log_r = log_r / lengths.clamp_min(1)
            units = lengths > 0
        r = log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
        below, above = (r < low) & units, (r > upper) & units
        inside = ~(below | above)
        keep &= inside if level == RejectionLevel.token else inside.unsqueeze(-1)
        count = units.sum().double()
        stats.update(mean_entries("below_frac", below.sum().double(), count))
        stats.update(mean_entries("above_frac", above.sum().double(), count))
    if veto is not None:
        catastrophic = mask & (raw < math.log(veto))
        vetoed = catastrophic.any(-1)
        keep &= ~vetoed.unsqueeze(-1)
        stats.update(mean_entries("veto_row_frac", vetoed.sum().double(), (mask.sum(-1) > 0).sum().double()))
        stats.update(mean_entries("veto_token_frac", catastrophic.sum().double(), mask.sum().double()))
    stats.update(mean_entries("rejected_token_frac", (mask & ~keep).sum().double(), mask.sum().double()))
    return keep, stats


def finalize_rejection_stats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """``mismatch_rs/<name>`` from (reduced) additive entries: the means, 0 where nothing was counted."""
    return {f"mismatch_rs/{name}": float(value.nan_to_num(0.0)) for name, value in finalize_metrics(stats).items()}
