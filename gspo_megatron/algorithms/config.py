"""``AlgorithmConfig``: which policy loss and advantage estimator to use, with what constants.

Design decisions:
- Variants are config values, not flags: ``loss`` names an entry of ``POLICY_LOSSES`` and
  ``advantage_estimator`` one of ``ADVANTAGE_ESTIMATORS``; validation checks both against the
  registries, so a new loss needs no change here.
- Defaults are GSPO's (arXiv 2507.18071: eps_low 3e-4, eps_high 4e-4, sequence-mean aggregation).
  GRPO's usual values (0.2 / 0.28, DAPO clip-higher) live in ``conf/algorithm/grpo.yaml``;
  ``RECOMMENDED_CLIP`` records both so tools can warn about a mismatched pair.
- ``AlgorithmConfig.validate`` (run at construction and by ``config/validate.py``, the
  ``ConfigNode`` convention) raises ``ValueError`` naming the field and the fix.
- ``make_loss_context`` is the one place a ``LossContext`` is built from config plus the per-step
  denominators, so the trainer never copies fields by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gspo_megatron.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageContext
from gspo_megatron.algorithms.kl import KL_ESTIMATORS
from gspo_megatron.algorithms.losses import (
    POLICY_LOSSES,
    SEQUENCE_LEVEL_LOSSES,
    Aggregation,
    Count,
    LossContext,
    check_clip_extensions,
    check_loss_settings,
    check_sequence_aggregation,
)
from gspo_megatron.algorithms.mismatch_correction import (
    MISMATCH_MODES,
    MismatchCorrection,
    RejectedTokens,
    SequenceRatio,
)
from gspo_megatron.algorithms.mismatch_rejection import RejectionLevel, rejection_lower
from gspo_megatron.algorithms.reductions import local_sequence_sum
from gspo_megatron.config_node import ConfigChoice, ConfigNode
from gspo_megatron.routing.replay import ReplayMode
from gspo_megatron.routing.replay_strategy import needs_trainer_old_pass

# (clip_low, clip_high) from the papers: GSPO arXiv 2507.18071; GRPO with DAPO's clip-higher.
RECOMMENDED_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.28)}


# Where pi_old comes from. ``rollout``: the engine's sampling log-probs (GSPO arXiv 2507.18071 §4.3:
# sequence-level likelihoods tolerate the engine/trainer precision gap) -- no old-log-prob forward.
class OldLogProbSource(ConfigChoice):
    trainer = "trainer"  # a forward pass of the trainer before the first update
    rollout = "rollout"  # the engine's sampling log-probs


OLD_LOG_PROB_SOURCES = tuple(OldLogProbSource)


@dataclass
class AlgorithmConfig(ConfigNode):
    name: str = "gspo"  # a label for logs and run names
    loss: str = "gspo"  # a POLICY_LOSSES name
    clip_low: float = 3e-4  # ratio floor 1 - clip_low
    clip_high: float = 4e-4  # ratio ceiling 1 + clip_high
    aggregation: Aggregation = Aggregation.seq_mean_token_mean
    log_ratio_clamp: float = 20.0  # |log ratio| bound applied before exp
    clip_ratio_c: float | None = None  # dual clip: J floored at c A where A < 0 (verl clip_ratio_c=3); None: off
    gspo_log_ratio_max: float | None = None  # upper bound on GSPO's log s_i (verl: 10); None: log_ratio_clamp
    advantage_estimator: str = "group_relative"  # an ADVANTAGE_ESTIMATORS name
    normalize_std: bool = True  # divide advantages by the group's reward std (False: Dr.GRPO)
    advantage_eps: float = 1e-6
    logprob_chunk_size: int | None = None  # tokens per chunk in vocab_parallel_log_probs; None: one
    routing_replay: ReplayMode = ReplayMode.none  # R2 / R3; see gspo_megatron/routing/replay.py
    entropy_coef: float = 0.0  # loss -= entropy_coef * aggregated entropy (verl entropy_coeff)
    kl_coef: float = 0.0  # loss += kl_coef * aggregated KL to a frozen reference; 0 skips the reference
    kl_estimator: str = "k3"  # k1 | k2 | k3 (algorithms/kl.py; verl kl_loss_type, TRL's beta term = k3)
    kl_reference: str | None = None  # a local HF checkpoint dir; None: the policy's initial weights
    mismatch_correction: MismatchCorrection = MismatchCorrection.none  # algorithms/mismatch_correction.py
    mismatch_cap: float = 2.0  # C in min(pi_old / pi_rollout, C) (algorithms/mismatch_correction.py)
    mismatch_sequence_ratio: SequenceRatio = SequenceRatio.geometric  # sequence modes: geometric mean | product
    mismatch_rejected: RejectedTokens = RejectedTokens.keep  # mask modes: keep rejected tokens in denominators | drop
    mismatch_lower: float = 0.0  # mask modes keep L <= rho <= C (token_mask with L: slime's IcePop)
    # rejection sampling (algorithms/mismatch_rejection.py, verl rollout_rs): tokens / rows whose ratio leaves
    # [lower, upper] leave the loss and its denominators; lower null: 1 / upper
    mismatch_reject: RejectionLevel = RejectionLevel.none
    mismatch_reject_upper: float = 2.0
    mismatch_reject_lower: float | None = None
    mismatch_veto: float | None = None  # a row with a token rho < veto is rejected (verl/slime veto); null: off
    # off-policy sequence masking (algorithms/off_policy_masking.py, slime --opsm-delta 1e-4): a sequence with
    # A < 0 whose mean log pi_old - log pi_theta exceeds it leaves the policy-gradient term; null: off
    opsm_delta: float | None = None
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups, draw more (trainer/dynamic_sampling.py)
    dynamic_sampling_max_extra_rounds: int = 4  # bound on extra generation rounds per step
    adaptive_clip_target: float | None = None  # target clipped fraction; None: fixed eps
    adaptive_clip_rate: float = 0.2  # log-space gain: eps moves by at most exp(rate) per step
    adaptive_clip_min_scale: float = 0.25  # eps stays within [min_scale, max_scale] x the configured eps
    adaptive_clip_max_scale: float = 4.0
    old_log_probs: OldLogProbSource = OldLogProbSource.trainer  # pi_old from a trainer pass or the engine

    def validate(self) -> None:
        _check_algorithm(self)


def _check_algorithm(cfg: AlgorithmConfig) -> None:
    """Raise ``ValueError`` naming the first inconsistent field of ``cfg`` and how to fix it."""
    if cfg.loss not in POLICY_LOSSES:
        raise ValueError(f"algorithm.loss={cfg.loss!r} is not a policy loss; valid: {', '.join(POLICY_LOSSES.names())}")
    if cfg.advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm.advantage_estimator={cfg.advantage_estimator!r} is unknown; valid: "
            f"{', '.join(ADVANTAGE_ESTIMATORS.names())}"
        )
    check_loss_settings(cfg.aggregation, cfg.clip_low, cfg.clip_high, cfg.log_ratio_clamp, prefix="algorithm.")
    check_clip_extensions(cfg.clip_ratio_c, cfg.gspo_log_ratio_max, prefix="algorithm.")
    if cfg.loss in SEQUENCE_LEVEL_LOSSES:
        check_sequence_aggregation(cfg.loss, cfg.aggregation, prefix="algorithm.")
    if cfg.advantage_eps < 0:
        raise ValueError(f"algorithm.advantage_eps must be >= 0, got {cfg.advantage_eps}")
    if not math.isfinite(cfg.entropy_coef):
        raise ValueError(f"algorithm.entropy_coef must be finite, got {cfg.entropy_coef}")
    if not (math.isfinite(cfg.kl_coef) and cfg.kl_coef >= 0):
        raise ValueError(f"algorithm.kl_coef must be >= 0 (0 turns the reference KL off), got {cfg.kl_coef}")
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"algorithm.kl_estimator={cfg.kl_estimator!r} is unknown; valid: {', '.join(KL_ESTIMATORS.names())}"
        )
    if cfg.kl_reference is not None and not Path(cfg.kl_reference).is_dir():
        raise ValueError(
            f"algorithm.kl_reference={cfg.kl_reference!r} is not a directory; point it at a local HF "
            "checkpoint (config.json + safetensors) or set it to null for the policy's initial weights"
        )
    if cfg.kl_reference is not None and cfg.kl_coef == 0:
        raise ValueError(
            f"algorithm.kl_reference={cfg.kl_reference!r} is set but algorithm.kl_coef=0 never uses it; "
            "set algorithm.kl_coef > 0 or drop kl_reference"
        )
    if cfg.mismatch_correction not in MISMATCH_MODES:
        raise ValueError(
            f"algorithm.mismatch_correction={cfg.mismatch_correction!r} is unknown; valid: {', '.join(MISMATCH_MODES)}"
        )
    if cfg.mismatch_correction.startswith("token_") and cfg.loss == "gspo":
        raise ValueError(
            f"algorithm.mismatch_correction={cfg.mismatch_correction} gives per-token weights, but loss=gspo has one "
            "ratio per sequence; use sequence_truncate/sequence_mask with gspo (or loss=gspo_token / grpo)"
        )
    if cfg.mismatch_sequence_ratio == SequenceRatio.product and not cfg.mismatch_correction.startswith("sequence_"):
        raise ValueError(
            f"algorithm.mismatch_sequence_ratio=product combines a row's token ratios, but "
            f"mismatch_correction={cfg.mismatch_correction} has no sequence weight; use sequence_truncate or "
            "sequence_mask, or leave mismatch_sequence_ratio=geometric"
        )
    if cfg.mismatch_rejected == RejectedTokens.drop and not cfg.mismatch_correction.endswith("_mask"):
        raise ValueError(
            f"algorithm.mismatch_rejected=drop removes the tokens a mask mode rejects, but "
            f"mismatch_correction={cfg.mismatch_correction} rejects none; use token_mask or sequence_mask, "
            "or set mismatch_rejected=keep"
        )
    if not cfg.mismatch_cap >= 1.0:
        raise ValueError(f"algorithm.mismatch_cap must be >= 1 (caps pi_old / pi_rollout), got {cfg.mismatch_cap}")
    _validate_rejection(cfg)
    if cfg.opsm_delta is not None and not cfg.opsm_delta >= 0:
        raise ValueError(f"algorithm.opsm_delta must be >= 0 or null (slime's default 1e-4), got {cfg.opsm_delta}")
    if cfg.dynamic_sampling_max_extra_rounds < 0:
        raise ValueError(
            f"algorithm.dynamic_sampling_max_extra_rounds must be >= 0, got {cfg.dynamic_sampling_max_extra_rounds}"
        )
    _validate_adaptive_clip(cfg)
    if cfg.old_log_probs not in OLD_LOG_PROB_SOURCES:
        raise ValueError(
            f"algorithm.old_log_probs={cfg.old_log_probs!r} is unknown; valid: {', '.join(OLD_LOG_PROB_SOURCES)}"
        )
    if cfg.old_log_probs == OldLogProbSource.rollout and needs_trainer_old_pass(cfg.routing_replay):
        raise ValueError(
            "algorithm.old_log_probs=rollout skips the trainer's old-policy forward, but "
            "routing_replay=old_policy replays the routing recorded in exactly that forward; use "
            "routing_replay=rollout (R3: the engine's routing, which produced the engine's log-probs) "
            "or none, or set algorithm.old_log_probs=trainer"
        )
    if cfg.old_log_probs == OldLogProbSource.rollout and corrects_mismatch(cfg):
        raise ValueError(
            f"algorithm.mismatch_correction={cfg.mismatch_correction} / mismatch_reject={cfg.mismatch_reject} / "
            f"mismatch_veto={cfg.mismatch_veto} use pi_old / pi_rollout, which is exactly 1 when "
            "algorithm.old_log_probs=rollout takes pi_old from the engine; turn them off or set old_log_probs=trainer"
        )
    if cfg.logprob_chunk_size is not None and cfg.logprob_chunk_size < 1:
        raise ValueError(f"algorithm.logprob_chunk_size must be >= 1 or null, got {cfg.logprob_chunk_size}")


def corrects_mismatch(cfg: AlgorithmConfig) -> bool:
    """Whether the step weighs or rejects by pi_old / pi_rollout (trainer/mismatch_phase.py runs)."""
    return (
        cfg.mismatch_correction != MismatchCorrection.none
        or cfg.mismatch_reject != RejectionLevel.none
        or cfg.mismatch_veto is not None
    )


def _validate_rejection(cfg: AlgorithmConfig) -> None:
    if not 0.0 <= cfg.mismatch_lower < 1.0:
        raise ValueError(
            f"algorithm.mismatch_lower must be in [0, 1) (mask modes keep rho >= it), got {cfg.mismatch_lower}"
        )
    if cfg.mismatch_lower > 0 and not cfg.mismatch_correction.endswith("_mask"):
        raise ValueError(
            f"algorithm.mismatch_lower={cfg.mismatch_lower} bounds what a mask mode keeps, but mismatch_correction="
            f"{cfg.mismatch_correction} masks nothing; use token_mask (slime's IcePop) or sequence_mask"
        )
    if cfg.mismatch_reject not in tuple(RejectionLevel):
        raise ValueError(
            f"algorithm.mismatch_reject={cfg.mismatch_reject!r} is unknown; valid: {', '.join(RejectionLevel)}"
        )
    lower = rejection_lower(cfg.mismatch_reject_upper, cfg.mismatch_reject_lower)
    if not (cfg.mismatch_reject_upper > 1.0 and 0.0 <= lower < 1.0):
        raise ValueError(
            f"algorithm.mismatch_reject_upper={cfg.mismatch_reject_upper} / mismatch_reject_lower="
            f"{cfg.mismatch_reject_lower} must give a band lower < 1 < upper around pi_old = pi_rollout "
            "(e.g. upper 2; verl's geo_rs: 1.001 and 0.999)"
        )
    if cfg.mismatch_veto is not None and not 0.0 < cfg.mismatch_veto < 1.0:
        raise ValueError(f"algorithm.mismatch_veto must be in (0, 1) or null (e.g. 1e-4), got {cfg.mismatch_veto}")


def _validate_adaptive_clip(cfg: AlgorithmConfig) -> None:
    if cfg.adaptive_clip_target is None:
        return
    if not 0 < cfg.adaptive_clip_target < 1:
        raise ValueError(
            f"algorithm.adaptive_clip_target must be in (0, 1) (a clipped fraction), got {cfg.adaptive_clip_target}"
        )
    if not cfg.adaptive_clip_rate > 0:
        raise ValueError(f"algorithm.adaptive_clip_rate must be > 0, got {cfg.adaptive_clip_rate}")
    if not 0 < cfg.adaptive_clip_min_scale <= 1 <= cfg.adaptive_clip_max_scale:
        raise ValueError(
            f"algorithm.adaptive_clip_min_scale={cfg.adaptive_clip_min_scale} and adaptive_clip_max_scale="
            f"{cfg.adaptive_clip_max_scale} must satisfy 0 < min_scale <= 1 <= max_scale"
        )
    if cfg.clip_low * cfg.adaptive_clip_max_scale >= 1:
        raise ValueError(
            f"algorithm.clip_low * adaptive_clip_max_scale = {cfg.clip_low * cfg.adaptive_clip_max_scale} "
            "would put the ratio floor 1 - eps_low at or below 0; lower adaptive_clip_max_scale"
        )


def make_loss_context(
    cfg: AlgorithmConfig,
    *,
    global_num_sequences: Count = None,
    global_num_tokens: Count = None,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] = local_sequence_sum,
    clip: tuple[float, float] | None = None,
) -> LossContext:
    """The ``LossContext`` for one micro-batch: config constants plus whole-batch denominators.
    ``clip``: this step's (eps_low, eps_high) when an adaptive controller scales them; None: the
    configured ``cfg.clip_low`` / ``cfg.clip_high``."""
    clip_low, clip_high = (cfg.clip_low, cfg.clip_high) if clip is None else clip
    return LossContext(
        clip_low=clip_low,
        clip_high=clip_high,
        aggregation=cfg.aggregation,
        global_num_sequences=global_num_sequences,
        global_num_tokens=global_num_tokens,
        log_ratio_clamp=cfg.log_ratio_clamp,
        sequence_sum=sequence_sum,
        clip_ratio_c=cfg.clip_ratio_c,
        gspo_log_ratio_max=cfg.gspo_log_ratio_max,
    )


def make_advantage_context(cfg: AlgorithmConfig, group_size: int) -> AdvantageContext:
    return AdvantageContext(group_size=group_size, normalize_std=cfg.normalize_std, eps=cfg.advantage_eps)
