"""The GSPO paper's mechanism as a measurement: how much of an importance ratio comes from routing.

The paper (arXiv 2507.18071, section on MoE training) argues that "expert-activation volatility makes
token-level importance ratios fluctuate". Per response token, with pi_theta the current weights and
pi_old the policy that produced the old log-probs:

    log w = log pi_theta(train routing) - log pi_old
          = [log pi_theta(train routing) - log pi_theta(old routing)]     routing part  r
          + [log pi_theta(old routing)   - log pi_old]                    weight part   v

"train routing" is the routing the loss's forward uses (free under ``routing.replay=none``; the old
pass's routing replayed under R2/R3, so there r = 0 by construction); "old routing" is the routing
the old-log-prob pass used, replayed into the current weights. At sequence level (GSPO's
length-normalised log-ratio) the same split holds for the means over a response's tokens:
log s_i = mean_t r + mean_t v.

Design decisions:
- Everything that leaves a micro-batch is a float64 sum or count in one vector (``RatioDecomposition``),
  so micro-batches, updates and data-parallel ranks merge exactly by addition and one all-reduce.
- Variance shares: Var(log w) = Var(r) + Var(v) + 2 Cov(r, v); the three shares (routing, weight,
  cross) sum to 1. Population moments over the valid tokens (sequences).
- "Changed" tokens: the token's expert set differs from the old routing's in >= 1 MoE layer at the
  input position that produces its log-prob (``volatility.topk_set_changed``). A sequence is
  changed when any of its response tokens is. The log-prob at position t also depends on earlier
  positions' routing through attention, so r can be non-zero at an unchanged token.
- Clip fraction: the clip is *active* as in ``algorithms/losses.py`` (A > 0 and ratio > 1 + eps_high,
  or A < 0 and ratio < 1 - eps_low), with the algorithm's eps at both levels: at GSPO's sequence
  eps (~3e-4) nearly every token ratio would be clipped, which is the paper's point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gspo_megatron.policy.routing.volatility import topk_set_changed

LEVELS = ("token", "seq")
PARTS = ("changed", "unchanged")
_MOMENTS = ("count", "routing", "weight", "routing_sq", "weight_sq", "routing_weight")
_PER_PART = ("count", "abs_log_ratio", "abs_routing", "abs_weight", "clipped")
FIELDS: tuple[str, ...] = tuple(
    [f"{level}/{m}" for level in LEVELS for m in _MOMENTS]
    + [f"{level}/{part}/{q}" for level in LEVELS for part in PARTS for q in _PER_PART]
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}


@dataclass
class RatioDecomposition:
    """Additive sums (float64 [len(FIELDS)]) of one or more micro-batches' decompositions."""

    sums: torch.Tensor

    @classmethod
    def zeros(cls, device="cpu") -> RatioDecomposition:
        return cls(torch.zeros(len(FIELDS), dtype=torch.float64, device=device))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.sums[_INDEX[name]]

    def merge(self, other: RatioDecomposition) -> RatioDecomposition:
        return RatioDecomposition(self.sums + other.sums.to(self.sums.device))

    def all_reduce_on(self, device, group) -> torch.Tensor:
        """The sums over ``group``'s ranks (each holds other rows, or zeros), reduced on ``device``
        (NCCL reduces device tensors only), back on the CPU."""
        sums = self.sums.to(device)
        dist.all_reduce(sums, group=group)
        return sums.cpu()

    def metrics(self, prefix: str = "ratio_decomp/") -> dict[str, float]:
        """Variance shares per level; per changed/unchanged: fraction, E|log w|, E|r|, E|v|, clip fraction.
        A share or mean over nothing is NaN (logged as such, never as 0)."""
        out: dict[str, float] = {}
        for level in LEVELS:
            n = float(self[f"{level}/count"])
            mean_r, mean_v = _ratio(self[f"{level}/routing"], n), _ratio(self[f"{level}/weight"], n)
            var_r = _ratio(self[f"{level}/routing_sq"], n) - mean_r**2
            var_v = _ratio(self[f"{level}/weight_sq"], n) - mean_v**2
            cov = _ratio(self[f"{level}/routing_weight"], n) - mean_r * mean_v
            total = var_r + var_v + 2 * cov  # Var(r + v)
            out[f"{prefix}{level}_var_log_ratio"] = total
            for name, variance in (("routing", var_r), ("weight", var_v), ("cross", 2 * cov)):
                out[f"{prefix}{level}_var_share_{name}"] = variance / total if total > 0 else float("nan")
            for part in PARTS:
                count = float(self[f"{level}/{part}/count"])
                out[f"{prefix}{level}_{part}_frac"] = _ratio(count, n)
                for q in ("abs_log_ratio", "abs_routing", "abs_weight"):
                    out[f"{prefix}{level}_{part}_{q}"] = _ratio(self[f"{level}/{part}/{q}"], count)
                out[f"{prefix}{level}_{part}_clip_frac"] = _ratio(self[f"{level}/{part}/clipped"], count)
        return out


def _ratio(total, count: float) -> float:
    return float(total) / count if count > 0 else float("nan")


def changed_in_any_layer(old: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """bool [N]: the token's expert set differs in >= 1 layer; top-k [N, L, k] each."""
    return topk_set_changed(old, now).any(dim=-1)


def _active_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float):
    ratio = log_ratio.exp()
    return ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))


def decompose_log_ratio(
    train_routing_log_probs: torch.Tensor,
    old_routing_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    changed: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> RatioDecomposition:
    """Sums of one micro-batch's decomposition. Whole rows: every [B, T]; ``changed`` bool [B, T]
    (expert set changed at the position scoring the target); ``advantages`` [B] or [B, T].

        r_t = lp_theta(train routing) - lp_theta(old routing);  v_t = lp_theta(old routing) - lp_old
        log w_t = r_t + v_t;  log s_i = (1/|y_i|) sum_t r_t + (1/|y_i|) sum_t v_t
    """
    shapes = {tuple(t.shape) for t in (train_routing_log_probs, old_routing_log_probs, old_log_probs, response_mask)}
    if len(shapes) != 1 or changed.shape != response_mask.shape:
        raise ValueError(f"log-probs, response_mask and changed must all be [B, T]; got {sorted(shapes)}")
    mask = response_mask.bool()
    f64 = torch.float64
    routing = torch.where(mask, train_routing_log_probs.to(f64) - old_routing_log_probs.to(f64), 0.0)
    weight = torch.where(mask, old_routing_log_probs.to(f64) - old_log_probs.to(f64), 0.0)
    token_adv = advantages.to(f64) if advantages.dim() == 2 else advantages.to(f64).unsqueeze(-1).expand_as(routing)
    lengths = mask.sum(dim=1)
    seq_valid = lengths > 0
    per_len = lengths.clamp_min(1).to(f64)
    seq_adv = torch.where(mask, token_adv, 0.0).sum(dim=1) / per_len  # A_i (or the mean of A_{i,t})
    levels = {
        "token": (routing[mask], weight[mask], (changed & mask)[mask], token_adv[mask]),
        "seq": (
            (routing.sum(dim=1) / per_len)[seq_valid],
            (weight.sum(dim=1) / per_len)[seq_valid],
            (changed & mask).any(dim=1)[seq_valid],
            seq_adv[seq_valid],
        ),
    }
    sums = torch.zeros(len(FIELDS), dtype=f64, device=routing.device)
    for level, (r, v, is_changed, adv) in levels.items():
        log_ratio = r + v
        values = {
            "count": torch.tensor(float(r.numel()), dtype=f64, device=r.device),
            "routing": r.sum(),
            "weight": v.sum(),
            "routing_sq": (r * r).sum(),
            "weight_sq": (v * v).sum(),
            "routing_weight": (r * v).sum(),
        }
        for name, value in values.items():
            sums[_INDEX[f"{level}/{name}"]] = value
        clipped = _active_clip(log_ratio, adv, clip_low, clip_high)
        for part, select in (("changed", is_changed), ("unchanged", ~is_changed)):
            per_part = {
                "count": select.sum(),
                "abs_log_ratio": log_ratio.abs()[select].sum(),
                "abs_routing": r.abs()[select].sum(),
                "abs_weight": v.abs()[select].sum(),
                "clipped": (clipped & select).sum(),
            }
            for name, value in per_part.items():
                sums[_INDEX[f"{level}/{part}/{name}"]] = value.to(f64)
    return RatioDecomposition(sums)
