"""Adaptive clipping: steer the clip range toward a target clipped fraction, step by step.

GSPO's clip range (3e-4 / 4e-4 in the paper) depends on response length and task, and the paper
names "automatic or adaptive clipping strategies" an open question. This controller is the simplest
answer, a multiplicative (log-space) proportional controller -- the same shape as PPO's adaptive-KL
controller (Schulman et al. 2017; Ziegler et al. 2019):

    e_k     = clamp( (f_k - f*) / f*, -1, 1 )            f_k: the step's clipped fraction, f* the target
    scale  <- clamp( scale * exp(rate * e_k), lo, hi )
    eps_low = scale * eps_low_0,  eps_high = scale * eps_high_0

More clipping than the target widens the range (fewer ratios leave it), less narrows it; the error is
relative to the target and bounded, so one wild step moves eps by at most a factor exp(rate).

Design decisions:
- One scale for both sides keeps the configured low/high asymmetry (clip-higher); the controlled
  fraction is their sum.
- The measured fraction is per sequence for the sequence-level losses (gspo, gspo_token: a
  sequence is clipped as a whole) and per token for grpo, as the trainer logs them
  (``loss/clip_frac_seq`` / ``loss/clip_frac_token``). With several updates per rollout it is the
  step's mean over updates (the first update of a step is on-policy and clips nothing).
- Bounds are multiples of the configured eps, so they read the same for GSPO and GRPO.
- The step's eps reach the loss as a clip range beside the config (``PolicyLossHead.clip``), never
  as an edited ``AlgorithmConfig``: the config keeps the *configured* eps, which is what its
  validation checks (``clip_low * max_scale < 1``), so the scaled eps are legal by construction.
- The trainer hands the step's fractions over as a typed ``ClipFractions`` (never looked up by
  metric name, so a renamed metric cannot turn the controller off). A step with no clipped fraction
  (NaN: no valid token, a skipped non-finite update) holds eps where they are; it is not silent:
  ``clip/held`` is 1 for that step and the trainer prints it.
- The state is one float; it is checkpointed so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gspo_megatron.algorithms.config import AlgorithmConfig

from gspo_megatron.algorithms.losses import SEQUENCE_LEVEL_LOSSES
from gspo_megatron.contracts.phases import ClipFractions


@dataclass
class AdaptiveClipController:
    clip_low: float  # configured eps_low_0
    clip_high: float  # configured eps_high_0
    target: float  # f*, in (0, 1)
    rate: float  # log-space gain
    min_scale: float
    max_scale: float
    per_sequence: bool  # steers the per-sequence fraction (sequence-level losses), else the per-token one
    scale: float = 1.0

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig) -> AdaptiveClipController | None:
        """None unless ``algorithm.adaptive_clip.target`` is set (``cfg`` is an ``AlgorithmConfig``)."""
        adaptive = cfg.adaptive_clip
        if adaptive.target is None:
            return None
        return cls(
            cfg.loss.clip_low,
            cfg.loss.clip_high,
            adaptive.target,
            adaptive.rate,
            adaptive.min_scale,
            adaptive.max_scale,
            cfg.loss.name in SEQUENCE_LEVEL_LOSSES,
        )

    @property
    def metric(self) -> str:
        """The logged name of the fraction it steers."""
        return "loss/clip_frac_seq" if self.per_sequence else "loss/clip_frac_token"

    def measured(self, fractions: ClipFractions) -> float:
        return fractions.seq if self.per_sequence else fractions.token

    @property
    def eps(self) -> tuple[float, float]:
        return self.scale * self.clip_low, self.scale * self.clip_high

    def update(self, clipped_fraction: float) -> dict[str, float]:
        """Move the scale after a step that clipped ``clipped_fraction``; returns the step's metrics
        (the eps that step used, the fraction, the target), then adapts for the next step."""
        low, high = self.eps
        metrics = {
            "clip/eps_low": low,
            "clip/eps_high": high,
            "clip/target": self.target,
            "clip/measured": clipped_fraction,
            "clip/scale": self.scale,
            "clip/held": 0.0 if math.isfinite(clipped_fraction) else 1.0,
        }
        if math.isfinite(clipped_fraction):  # no signal (no valid tokens, non-finite loss): eps held
            error = max(-1.0, min(1.0, (clipped_fraction - self.target) / self.target))
            self.scale = min(self.max_scale, max(self.min_scale, self.scale * math.exp(self.rate * error)))
        return metrics

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
