"""Config dataclasses for the reward shapers (Hydra group ``shaping``).

Design decisions:
- One ``ShapingConfig`` selects a shaper by ``name``; each shaper's options live in the field of
  the same name (``step_grpo``, ``grsp``, ...), so one YAML per shaper sets ``name`` and overrides its
  own section. ``none`` has no options. A newly registered shaper adds its section here.
- Every dataclass validates itself in ``__post_init__`` (run by ``OmegaConf.to_object``), with
  errors that name the field and the fix. ``ShapingConfig.validate`` also checks that ``name`` is a
  registered shaper (the shaper modules register on ``import gspo_megatron.rollout.shaping``).
- ``metrics`` configures the diagnostics logged for EVERY shaper (steps, segments per length
  cluster), so a baseline run (``none``) is measured on the same scale as a shaped run.
- Plain str fields with checked values, not Literal/Enum, keep the YAML simple.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from gspo_megatron.core.config_node import ConfigChoice, ConfigNode


def _check_triggers(owner: str, triggers: list[str]) -> None:
    if not triggers or any(not isinstance(t, str) or not t.strip() for t in triggers):
        raise ValueError(
            f"{owner}: trigger words must be a non-empty list of non-empty strings, got {list(triggers)!r}"
        )


def _check_edges(owner: str, edges: list[float]) -> None:
    values = list(edges)
    if not values:
        raise ValueError(f"{owner}.bucket_edges must hold at least one edge (two length clusters)")
    if any(v <= 0 for v in values) or any(b <= a for a, b in pairwise(values)):
        raise ValueError(f"{owner}.bucket_edges must be positive and strictly increasing, got {values}")


class StepGRPOOutcome(ConfigChoice):
    """``shaping.step_grpo.outcome`` (see ``StepGRPOConfig.outcome``)."""

    boxed = "boxed"
    verifier = "verifier"


class Segmentation(ConfigChoice):
    """``shaping.grsp.segmentation``."""

    keyword = "keyword"  # text triggers
    confidence = "confidence"  # log-prob local minima


class WeightOrder(ConfigChoice):
    """``shaping.grsp.weight_order``."""

    descending = "descending"  # short-segment clusters weigh most (the paper)
    ascending = "ascending"


class ApplyTo(ConfigChoice):
    """``shaping.grsp.apply_to``."""

    correct = "correct"  # z-score and penalise correct responses only
    all = "all"


class ShapingCombine(ConfigChoice):
    """``shaping.combine`` (``rollout/shaping/combine.py``)."""

    reward = "reward"  # shape the reward, then the advantage estimator (the papers)
    advantage = "advantage"  # normalise the task reward, then add the centred shaping term


STEP_GRPO_OUTCOMES = tuple(StepGRPOOutcome)
# task verifier -> the verifier that grades as Step-GRPO defines acc/fmt (boxed answer)
BOXED_OUTCOME_REWARDS = {"math_verify": "math_verify_boxed"}


@dataclass
class StepGRPOConfig(ConfigNode):
    """Step-GRPO reward (arXiv 2604.16890): R = alpha*acc*(1 - beta*tanh((k-mu)/mu)) + (1-alpha)*fmt."""

    alpha: float = 0.9  # weight of the accuracy(+efficiency) term vs the format term
    beta: float = 0.5  # strength of the step-count efficiency term (k counts shaping.trigger_words)
    # acc/fmt. "boxed" (the method): on tasks whose verifier has a boxed variant (math_verify ->
    # math_verify_boxed) acc grades the last \boxed{} and fmt = 1 when a box exists; other tasks keep
    # their verifier. "verifier": the task verifier's correct/format_ok as they are (math_verify also
    # accepts the last number without a box, and its format_ok requires termination).
    outcome: StepGRPOOutcome = StepGRPOOutcome.boxed
    # CHOICE: how steps are counted before a Dynamic Truncated Rollout exit. A confident exit drops the
    # trigger word it probed at (the paper: "discard the probe, close the thinking block"), so the text
    # holds k = 1 + the triggers that were restored. false (default): count the text as it is -- the
    # steps the response actually contains. true: also count the dropped trigger as the step the exit
    # cut short (k + 1 for a confident exit), so an exit at the first trigger counts 2 like a response
    # that went on to a second step.
    count_dropped_trigger: bool = False

    def validate(self) -> None:
        if self.outcome not in STEP_GRPO_OUTCOMES:
            raise ValueError(f"shaping.step_grpo.outcome must be one of {STEP_GRPO_OUTCOMES}, got {self.outcome!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"shaping.step_grpo.alpha must be in [0, 1], got {self.alpha}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(
                f"shaping.step_grpo.beta must be in [0, 1] (so a correct response never scores below "
                f"an incorrect one), got {self.beta}"
            )


GRSP_SEGMENTATIONS = tuple(Segmentation)
GRSP_WEIGHT_ORDERS = tuple(WeightOrder)
GRSP_APPLY_TO = tuple(ApplyTo)


@dataclass
class GRSPConfig(ConfigNode):
    """GRSP segment penalty (arXiv 2510.09535) -- a RECONSTRUCTION; every constant is a guess to tune."""

    penalty_coef: float = 0.1  # lambda in r_i - lambda * P_i
    segmentation: Segmentation = Segmentation.keyword
    keywords: list[str] = field(default_factory=lambda: ["Wait", "Alternatively", "Hmm", "However", "But wait"])
    case_sensitive: bool = True
    # Calibrated against keyword boundaries on the warm-started tiny model (tools/
    # calibrate_confidence_segmentation.py -> reports/shaping_study/confidence_calibration.json):
    # window 1, threshold -0.1 agree best (F1 0.49: recall 1.0, precision 0.32, +-1 token); the old
    # guess (3, -1.0) had F1 0.05. A larger model has other log-prob scales: re-run the tool on it.
    confidence_window: int = 1  # tokens on each side a boundary must be the minimum of
    confidence_threshold: float = -0.1  # boundary log-prob must be below this (p < ~0.90)
    bucket_edges: list[float] = field(default_factory=lambda: [64.0, 256.0])  # tokens; K = len + 1
    weight_order: WeightOrder = WeightOrder.descending
    cluster_weights: list[float] = field(default_factory=list)  # empty: linear K..1 profile, normalised
    apply_to: ApplyTo = ApplyTo.correct

    def validate(self) -> None:
        owner = "shaping.grsp"
        if self.penalty_coef < 0:
            raise ValueError(f"{owner}.penalty_coef must be >= 0, got {self.penalty_coef}")
        for key, allowed in (
            ("segmentation", GRSP_SEGMENTATIONS),
            ("weight_order", GRSP_WEIGHT_ORDERS),
            ("apply_to", GRSP_APPLY_TO),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{owner}.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        _check_triggers(owner, self.keywords)
        if self.confidence_window < 1:
            raise ValueError(f"{owner}.confidence_window must be >= 1, got {self.confidence_window}")
        _check_edges(owner, self.bucket_edges)
        weights = list(self.cluster_weights)
        if weights:
            clusters = len(self.bucket_edges) + 1
            if len(weights) != clusters:
                raise ValueError(
                    f"{owner}.cluster_weights has {len(weights)} entries but bucket_edges make "
                    f"{clusters} clusters; give one weight per cluster or leave it empty"
                )
            if any(w < 0 for w in weights):
                raise ValueError(f"{owner}.cluster_weights must be >= 0, got {weights}")
            pairs = list(pairwise(weights))
            monotone = (
                all(a >= b for a, b in pairs)
                if self.weight_order == WeightOrder.descending
                else all(a <= b for a, b in pairs)
            )
            if not monotone:
                raise ValueError(
                    f"{owner}.cluster_weights {weights} are not {self.weight_order} (cluster 0 is the "
                    f"shortest); reorder them or change weight_order"
                )

    def resolved_weights(self) -> list[float]:
        """w_k per length cluster (shortest first): the given weights, or K..1 normalised to sum 1."""
        if self.cluster_weights:
            return [float(w) for w in self.cluster_weights]
        clusters = len(self.bucket_edges) + 1
        total = clusters * (clusters + 1) / 2
        descending = [(clusters - k) / total for k in range(clusters)]
        return descending if self.weight_order == WeightOrder.descending else descending[::-1]


@dataclass
class DAPOOverlongConfig(ConfigNode):
    """DAPO soft overlong punishment (arXiv 2503.14476), added to the reward."""

    max_length: int | None = None  # L_max; None: the group's max_response_length
    cache_length: int = 4096  # L_cache, the soft-punishment zone before L_max (DAPO: 4096 of 20480)

    def validate(self) -> None:
        if self.cache_length < 1:
            raise ValueError(f"shaping.dapo_overlong.cache_length must be >= 1, got {self.cache_length}")
        if self.max_length is not None and self.max_length < self.cache_length:
            raise ValueError(
                f"shaping.dapo_overlong.max_length ({self.max_length}) must be >= cache_length ({self.cache_length})"
            )


@dataclass
class KimiLengthConfig(ConfigNode):
    """Kimi k1.5 length reward (arXiv 2501.12599), added to the reward times ``weight``."""

    weight: float = 1.0

    def validate(self) -> None:
        if self.weight < 0:
            raise ValueError(f"shaping.kimi_length.weight must be >= 0, got {self.weight}")


@dataclass
class ShapingMetricsConfig(ConfigNode):
    """Diagnostics logged for every shaper (steps and segment-length clusters, by shaping.trigger_words)."""

    bucket_edges: list[float] = field(default_factory=lambda: [64.0, 256.0])

    def validate(self) -> None:
        _check_edges("shaping.metrics", self.bucket_edges)


@dataclass
class ShapingConfig(ConfigNode):
    name: str = "none"  # a registered shaper: none, step_grpo, grsp, dapo_overlong, kimi_length
    # The words that start a reasoning step, the one list for everything that counts or probes steps:
    # Step-GRPO's k, the step and segment metrics, Dynamic Truncated Rollout's probes (rollout.truncated;
    # matched case-sensitively there, as engine stop strings). Whole words (gspo_megatron/core/trigger_words.py).
    # CHOICE: Step-GRPO names "Wait" and "Alternatively"; DEER's released code uses "Wait" alone.
    trigger_words: list[str] = field(default_factory=lambda: ["Wait", "Alternatively"])
    trigger_case_sensitive: bool = True
    step_grpo: StepGRPOConfig = field(default_factory=StepGRPOConfig)
    grsp: GRSPConfig = field(default_factory=GRSPConfig)
    dapo_overlong: DAPOOverlongConfig = field(default_factory=DAPOOverlongConfig)
    kimi_length: KimiLengthConfig = field(default_factory=KimiLengthConfig)
    metrics: ShapingMetricsConfig = field(default_factory=ShapingMetricsConfig)
    # Ramp the shaping in over the first N RL steps: r = raw + min(1, step/N) * (shaped - raw).
    # Kimi k1.5 warms its length reward up this way; without it the length term can win before
    # the policy has learned to be correct (measured: kimi_length collapses to an immediate <eos>).
    warmup_steps: int = 0
    # "advantage" (default): normalise the task reward, then add the centred shaping term -- keeps
    # lambda/beta's scale in all-correct groups, where std normalisation erases it (rollout/shaping/combine.py
    # says why this is the default). "reward": shape the reward, then the advantage estimator (the papers).
    combine: ShapingCombine = ShapingCombine.advantage

    def validate(self) -> None:
        from gspo_megatron.rollout.shaping.registry import SHAPERS

        SHAPERS.get(self.name)  # raises with the list of valid names
        _check_triggers("shaping.trigger_words", self.trigger_words)
        if self.combine not in tuple(ShapingCombine):
            raise ValueError(f"shaping.combine must be one of {tuple(ShapingCombine)}, got {self.combine!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"shaping.warmup_steps must be >= 0, got {self.warmup_steps}")

    def strength(self, step: int) -> float:
        """The share of the shaping applied at RL step ``step`` (0-based): 1 after the warm-up."""
        return 1.0 if self.warmup_steps == 0 else min(1.0, step / self.warmup_steps)

    def reward_name(self, task_reward: str) -> str:
        """The verifier to score with: Step-GRPO's boxed acc/fmt where the task has one, else the task's."""
        if self.name == "step_grpo" and self.step_grpo.outcome == StepGRPOOutcome.boxed:
            return BOXED_OUTCOME_REWARDS.get(task_reward, task_reward)
        return task_reward

    def shaper_config(self) -> object | None:
        """The options section of the selected shaper (None for shapers without options)."""
        return getattr(self, self.name, None)
