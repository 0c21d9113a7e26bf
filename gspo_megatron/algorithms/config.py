"""``AlgorithmConfig``: the policy loss, advantages, regularisers and corrections, one section each.

    algorithm.name               a label for logs and run names
    algorithm.loss.*             the policy loss and every setting the loss head reads (``LossConfig``,
                                 ``algorithms/losses.py``): name, clip, aggregation, clamps, entropy, OPSM
    algorithm.advantage.*        the advantage estimator
    algorithm.kl.*               the reference KL term (coef 0: no reference model)
    algorithm.mismatch.*         importance weights / rejection by pi_old / pi_rollout
    algorithm.adaptive_clip.*    eps steered by the clipped fraction (target null: fixed eps)
    algorithm.dynamic_sampling.* DAPO's group filter

Routing replay is ``routing.replay`` and pi_old's source ``trainer.old_log_probs``: they decide what
runs, not what is optimised. Run directories written before this layout resume: ``core/config_migrations.py``
maps their keys.

Design decisions:
- Variants are config values, not flags: ``loss.name`` names an entry of ``POLICY_LOSSES`` and
  ``advantage.estimator`` one of ``ADVANTAGE_ESTIMATORS``; validation checks both against the
  registries, so a new loss needs no change here.
- Defaults are GSPO's (arXiv 2507.18071: eps_low 3e-4, eps_high 4e-4, sequence-mean aggregation).
  GRPO's usual values (0.2 / 0.28, DAPO clip-higher) live in ``conf/algorithm/grpo.yaml``; a preset
  states only what it changes. ``RECOMMENDED_CLIP`` records both so tools can warn about a mismatched pair.
- Each section validates its own fields at construction (the ``ConfigNode`` convention, ``ValueError``
  naming the key and the fix); ``AlgorithmConfig.validate`` adds the rules across its sections and
  ``config/validate.py`` those across the config's sections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from gspo_megatron.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageContext
from gspo_megatron.algorithms.kl import KL_ESTIMATORS
from gspo_megatron.algorithms.losses import LossConfig
from gspo_megatron.algorithms.mismatch_correction import (
    MISMATCH_MODES,
    MismatchCorrection,
    RejectedTokens,
    SequenceRatio,
)
from gspo_megatron.algorithms.mismatch_rejection import RejectionLevel, rejection_lower
from gspo_megatron.core.config_node import ConfigChoice, ConfigNode

# (clip_low, clip_high) from the papers: GSPO arXiv 2507.18071; GRPO with DAPO's clip-higher.
RECOMMENDED_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.28)}


# Where pi_old comes from (``trainer.old_log_probs``). ``rollout``: the engine's sampling log-probs (GSPO
# arXiv 2507.18071 §4.3: sequence-level likelihoods tolerate the engine/trainer precision gap) -- no
# old-log-prob forward.
class OldLogProbSource(ConfigChoice):
    trainer = "trainer"  # a forward pass of the trainer before the first update
    rollout = "rollout"  # the engine's sampling log-probs


OLD_LOG_PROB_SOURCES = tuple(OldLogProbSource)


@dataclass
class AdvantageConfig(ConfigNode):
    """``algorithm.advantage``."""

    estimator: str = "group_relative"  # an ADVANTAGE_ESTIMATORS name
    normalize_std: bool = True  # divide advantages by the group's reward std (False: Dr.GRPO)
    eps: float = 1e-6
    # w: a multi-turn trajectory's per-turn rewards enter its tokens' advantages, A_i + w * u_{i,t} on the tokens
    # turn t generated (rollout/agents/turn_rewards.py); 0: off, one advantage per trajectory
    turn_reward_weight: float = 0.0

    def validate(self) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"algorithm.advantage.estimator={self.estimator!r} is unknown; valid: "
                f"{', '.join(ADVANTAGE_ESTIMATORS.names())}"
            )
        if self.eps < 0:
            raise ValueError(f"algorithm.advantage.eps must be >= 0, got {self.eps}")
        if not (math.isfinite(self.turn_reward_weight) and self.turn_reward_weight >= 0):
            raise ValueError(f"algorithm.advantage.turn_reward_weight must be >= 0, got {self.turn_reward_weight}")


@dataclass
class KLConfig(ConfigNode):
    """``algorithm.kl``: loss += coef * aggregated KL to a frozen reference; coef 0 builds no reference."""

    coef: float = 0.0
    estimator: str = "k3"  # k1 | k2 | k3 | low_var_kl (algorithms/kl.py; verl kl_loss_type, TRL's beta term = k3)
    reference: str | None = None  # a local HF checkpoint dir; None: the policy's initial weights

    def validate(self) -> None:
        if not (math.isfinite(self.coef) and self.coef >= 0):
            raise ValueError(f"algorithm.kl.coef must be >= 0 (0 turns the reference KL off), got {self.coef}")
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"algorithm.kl.estimator={self.estimator!r} is unknown; valid: {', '.join(KL_ESTIMATORS.names())}"
            )
        if self.reference is not None and not Path(self.reference).is_dir():
            raise ValueError(
                f"algorithm.kl.reference={self.reference!r} is not a directory; point it at a local HF "
                "checkpoint (config.json + safetensors) or set it to null for the policy's initial weights"
            )
        if self.reference is not None and self.coef == 0:
            raise ValueError(
                f"algorithm.kl.reference={self.reference!r} is set but algorithm.kl.coef=0 never uses it; "
                "set algorithm.kl.coef > 0 or drop the reference"
            )


@dataclass
class MismatchConfig(ConfigNode):
    """``algorithm.mismatch``: the train/inference mismatch pi_old / pi_rollout, corrected
    (``algorithms/mismatch_correction.py``) or rejected (``algorithms/mismatch_rejection.py``)."""

    correction: MismatchCorrection = MismatchCorrection.none
    cap: float = 2.0  # C in min(pi_old / pi_rollout, C); decoupled: the mask's bound (AReaL's cap: 5)
    sequence_ratio: SequenceRatio = SequenceRatio.geometric  # sequence modes: geometric mean | product
    rejected: RejectedTokens = RejectedTokens.keep  # mask modes: keep rejected tokens in denominators | drop
    lower: float = 0.0  # mask modes keep L <= rho <= C (token_mask with L: slime's IcePop)
    # rejection sampling (verl rollout_rs): tokens / rows whose ratio leaves [reject_lower, reject_upper]
    # leave the loss and its denominators; reject_lower null: 1 / reject_upper
    reject: RejectionLevel = RejectionLevel.none
    reject_upper: float = 2.0
    reject_lower: float | None = None
    veto: float | None = None  # a row with a token rho < veto is rejected (verl/slime veto); null: off

    @property
    def active(self) -> bool:
        """Whether the step weighs or rejects by pi_old / pi_rollout (loop/corrections.py runs)."""
        return self.correction != MismatchCorrection.none or self.reject != RejectionLevel.none or self.veto is not None

    def validate(self) -> None:
        key = "algorithm.mismatch."
        if self.correction not in MISMATCH_MODES:
            raise ValueError(f"{key}correction={self.correction!r} is unknown; valid: {', '.join(MISMATCH_MODES)}")
        if self.sequence_ratio == SequenceRatio.product and not MismatchCorrection(self.correction).per_sequence:
            raise ValueError(
                f"{key}sequence_ratio=product combines a row's token ratios, but {key}correction="
                f"{self.correction} has no sequence weight; use sequence_truncate or sequence_mask, or leave "
                "sequence_ratio=geometric"
            )
        if self.rejected == RejectedTokens.drop and self.correction == MismatchCorrection.decoupled:
            raise ValueError(
                f"{key}rejected=drop with {key}correction=decoupled: AReaL's decoupled loss keeps the tokens its "
                "cap masks in the denominators; set rejected=keep, or use correction=token_mask with rejected=drop"
            )
        if self.rejected == RejectedTokens.drop and not MismatchCorrection(self.correction).masks:
            raise ValueError(
                f"{key}rejected=drop removes the tokens a mask mode rejects, but {key}correction="
                f"{self.correction} rejects none; use token_mask or sequence_mask, or set rejected=keep"
            )
        if not self.cap >= 1.0:
            raise ValueError(f"{key}cap must be >= 1 (caps pi_old / pi_rollout), got {self.cap}")
        if not 0.0 <= self.lower < 1.0:
            raise ValueError(f"{key}lower must be in [0, 1) (mask modes keep rho >= it), got {self.lower}")
        if self.lower > 0 and not MismatchCorrection(self.correction).masks:
            raise ValueError(
                f"{key}lower={self.lower} bounds what a mask mode keeps, but {key}correction="
                f"{self.correction} masks nothing; use token_mask (slime's IcePop) or sequence_mask"
            )
        if self.reject not in tuple(RejectionLevel):
            raise ValueError(f"{key}reject={self.reject!r} is unknown; valid: {', '.join(RejectionLevel)}")
        lower = rejection_lower(self.reject_upper, self.reject_lower)
        if not (self.reject_upper > 1.0 and 0.0 <= lower < 1.0):
            raise ValueError(
                f"{key}reject_upper={self.reject_upper} / reject_lower={self.reject_lower} must give a band "
                "lower < 1 < upper around pi_old = pi_rollout (e.g. upper 2; verl's geo_rs: 1.001 and 0.999)"
            )
        if self.veto is not None and not 0.0 < self.veto < 1.0:
            raise ValueError(f"{key}veto must be in (0, 1) or null (e.g. 1e-4), got {self.veto}")


@dataclass
class AdaptiveClipConfig(ConfigNode):
    """``algorithm.adaptive_clip``: eps steered towards a target clipped fraction (``algorithms/adaptive_clip.py``)."""

    target: float | None = None  # target clipped fraction; None: fixed eps
    rate: float = 0.2  # log-space gain: eps moves by at most exp(rate) per step
    min_scale: float = 0.25  # eps stays within [min_scale, max_scale] x the configured eps
    max_scale: float = 4.0

    def validate(self) -> None:
        if self.target is None:
            return
        key = "algorithm.adaptive_clip."
        if not 0 < self.target < 1:
            raise ValueError(f"{key}target must be in (0, 1) (a clipped fraction), got {self.target}")
        if not self.rate > 0:
            raise ValueError(f"{key}rate must be > 0, got {self.rate}")
        if not 0 < self.min_scale <= 1 <= self.max_scale:
            raise ValueError(
                f"{key}min_scale={self.min_scale} and max_scale={self.max_scale} must satisfy "
                "0 < min_scale <= 1 <= max_scale"
            )


@dataclass
class DynamicSamplingConfig(ConfigNode):
    """``algorithm.dynamic_sampling``: DAPO -- drop zero-variance groups, draw more (rollout/dynamic_sampling.py)."""

    enabled: bool = False
    max_extra_rounds: int = 4  # bound on extra generation rounds per step

    def validate(self) -> None:
        if self.max_extra_rounds < 0:
            raise ValueError(f"algorithm.dynamic_sampling.max_extra_rounds must be >= 0, got {self.max_extra_rounds}")


@dataclass
class AlgorithmConfig(ConfigNode):
    name: str = "gspo"  # a label for logs and run names
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    adaptive_clip: AdaptiveClipConfig = field(default_factory=AdaptiveClipConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)

    def validate(self) -> None:
        """The rules across this config's sections (each section checked its own fields)."""
        correction = self.mismatch.correction
        if MismatchCorrection(correction).per_token and self.loss.name == "gspo":
            raise ValueError(
                f"algorithm.mismatch.correction={correction} gives per-token weights, but algorithm.loss.name=gspo "
                "has one ratio per sequence; use sequence_truncate/sequence_mask with gspo (or gspo_token / grpo)"
            )
        if self.advantage.turn_reward_weight > 0 and self.loss.name == "gspo":
            raise ValueError(
                f"algorithm.advantage.turn_reward_weight={self.advantage.turn_reward_weight} gives the tokens of each "
                "turn their own advantage, but algorithm.loss.name=gspo clips one sequence ratio s_i against one "
                "advantage per trajectory, min(s_i A_i, clip(s_i) A_i): a per-turn advantage has no term to enter. "
                "Use algorithm.loss.name=gspo_token (GSPO's s_i on every token, each token's gradient weighted by its "
                "own turn's advantage: arXiv 2507.18071 sec. 4.3) or grpo, or set turn_reward_weight=0"
            )
        clip = self.adaptive_clip
        if clip.target is not None and self.loss.clip_low * clip.max_scale >= 1:
            raise ValueError(
                f"algorithm.loss.clip_low * algorithm.adaptive_clip.max_scale = {self.loss.clip_low * clip.max_scale} "
                "would put the ratio floor 1 - eps_low at or below 0; lower adaptive_clip.max_scale"
            )


def make_advantage_context(cfg: AdvantageConfig, group_size: int) -> AdvantageContext:
    return AdvantageContext(group_size=group_size, normalize_std=cfg.normalize_std, eps=cfg.eps)
