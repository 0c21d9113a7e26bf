"""Policy losses GSPO, GSPO-token and GRPO: pure tensor functions behind one registry and one signature.

    loss_fn(log_probs [B,T], old_log_probs [B,T], advantages [B] or [B,T], response_mask [B,T],
            ctx: LossContext) -> PolicyLossOutput(loss, metrics, clip_sides)

Design decisions:
- The returned loss is *minimised* (= -J) and is this micro-batch's contribution to the whole batch:
  every aggregation divides by the global denominators in ``ctx`` (sequences or valid tokens over all
  micro-batches and data-parallel ranks), so summing losses and gradients over micro-batches and ranks
  gives the one-big-batch loss and gradient. Without global denominators the local counts are used.
- Every sum over a sequence's tokens goes through ``ctx.sequence_sum`` (default: sum over T). Under
  context parallelism the caller passes the CP reducer from ``reductions.py``; then |y_i|, s_i and
  per-sequence sums are whole-sequence values on every CP rank while gradients stay local.
- Ratios are formed in log space, the log-ratio clamped to +-``log_ratio_clamp`` before ``exp``;
  positions outside the mask are removed with ``where`` (not multiplied by 0), so a -inf log-prob at
  padding cannot turn into NaN. Sequences with no valid token contribute nothing.
- "Clipped" means the clip is *active* (the min picks the clipped term and the gradient is zero):
  high: A > 0 and ratio > 1 + eps_high; low: A < 0 and ratio < 1 - eps_low.
- A loss's settings are ``algorithm.loss`` (``LossConfig``, validated once, where a new option goes);
  ``LossContext`` is that section plus the whole-batch denominators and this step's eps -- no copy.
- Dual clip (Ye et al. 2020, arXiv 1912.09729; verl ``clip_ratio_c``, slime ``--eps-clip-c``) is
  optional (``ctx.loss.clip_ratio_c``): where A < 0 the objective is floored at c A, so a ratio above c
  cannot push an unboundedly large negative term; there ("dual"-clipped) the gradient is zero.
- GSPO's sequence log-ratio has its own upper bound ``ctx.loss.gspo_log_ratio_max`` (verl clamps log s_i
  at max 10 and nothing below); None bounds it like every other log-ratio, at +-log_ratio_clamp.
- GSPO's ratio is already length-normalised per sequence, so GSPO and GSPO-token accept only
  "seq_mean_token_mean"; a token-weighted aggregation would re-introduce the length bias GSPO removes.
- Metrics (see ``metrics.py``): clip fractions per token and per sequence, split low/high (per
  sequence = mean over sequences of the fraction of that sequence's tokens clipped; for GSPO that is
  the indicator) -- a typed field of every loss's output (``ClipSides``), so none can leave out the
  headline fractions; KL(pi_old || pi_theta) estimated from tokens sampled from pi_old, with r = pi/pi_old:
  k1 = -log r and k3 = (r - 1) - log r (both unbiased; k3 is >= 0 and lower-variance; both logged);
  the clipped ratio's mean/min/max (per sequence s_i for GSPO variants, per token w for GRPO);
  response length; token- vs sequence-ratio dispersion by response length (``ratio_dispersion.py``).
  Entropy comes from ``vocab_parallel_log_probs``; add it with ``token_mean_metric``.

References: GSPO, Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071;
GRPO, Shao et al., "DeepSeekMath", arXiv 2402.03300; clip-higher from DAPO, arXiv 2503.14476.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from gspo_megatron.algorithms.metrics import extremum_entries, mean_entries
from gspo_megatron.algorithms.ratio_dispersion import ratio_dispersion_metrics
from gspo_megatron.algorithms.reductions import local_sequence_sum
from gspo_megatron.core.config_node import ConfigChoice, ConfigNode
from gspo_megatron.core.registry import Registry


class Aggregation(ConfigChoice):
    """How per-token terms become one loss (``algorithm.loss.aggregation``; see ``_aggregate_tokens``)."""

    seq_mean_token_mean = "seq_mean_token_mean"
    token_mean = "token_mean"
    seq_mean_token_sum = "seq_mean_token_sum"


AGGREGATIONS = tuple(Aggregation)
SEQUENCE_LEVEL_AGGREGATIONS = ("seq_mean_token_mean",)  # the only ones GSPO's ratio is consistent with
SEQUENCE_LEVEL_LOSSES = ("gspo", "gspo_token")  # the losses whose ratio is length-normalised per sequence
PER_ROW_ADVANTAGE_LOSSES = ("gspo",)  # the losses that take one advantage per sequence ([B]), not per token

Count = torch.Tensor | float | int | None


@dataclass
class LossConfig(ConfigNode):
    """``algorithm.loss``: which policy loss, and every setting the loss head reads. A new option is a
    field here (with its rule in ``validate``), read in the loss as ``ctx.loss.<option>``."""

    name: str = "gspo"  # a POLICY_LOSSES name
    clip_low: float = 3e-4  # ratio floor 1 - clip_low
    clip_high: float = 4e-4  # ratio ceiling 1 + clip_high
    aggregation: Aggregation = Aggregation.seq_mean_token_mean
    log_ratio_clamp: float = 20.0  # |log ratio| bound applied before exp
    clip_ratio_c: float | None = None  # dual clip: J floored at c A where A < 0 (verl clip_ratio_c=3); None: off
    gspo_log_ratio_max: float | None = None  # upper bound on GSPO's log s_i (verl: 10); None: log_ratio_clamp
    entropy_coef: float = 0.0  # loss -= entropy_coef * aggregated entropy (verl entropy_coeff)
    # off-policy sequence masking (algorithms/off_policy_masking.py, slime --opsm-delta 1e-4): a sequence with
    # A < 0 whose mean log pi_old - log pi_theta exceeds it leaves the policy-gradient term; null: off
    opsm_delta: float | None = None
    # seq_mean_token_sum: each sequence's token sum also divided by this constant -- TRL's loss_type=dr_grpo
    # (its max_completion_length), Dr. GRPO's generation budget (arXiv 2503.20783); null: 1
    token_sum_divisor: float | None = None

    def validate(self) -> None:
        prefix = "algorithm.loss."
        if self.name not in POLICY_LOSSES:
            raise ValueError(
                f"{prefix}name={self.name!r} is not a policy loss; valid: {', '.join(POLICY_LOSSES.names())}"
            )
        check_loss_settings(self.aggregation, self.clip_low, self.clip_high, self.log_ratio_clamp, prefix=prefix)
        check_clip_extensions(self.clip_ratio_c, self.gspo_log_ratio_max, prefix=prefix)
        if self.name in SEQUENCE_LEVEL_LOSSES:
            check_sequence_aggregation(self.name, self.aggregation, prefix=prefix)
        if not math.isfinite(self.entropy_coef):
            raise ValueError(f"{prefix}entropy_coef must be finite, got {self.entropy_coef}")
        if self.opsm_delta is not None and not self.opsm_delta >= 0:
            raise ValueError(f"{prefix}opsm_delta must be >= 0 or null (slime's default 1e-4), got {self.opsm_delta}")
        if self.token_sum_divisor is not None and not (
            self.token_sum_divisor > 0 and self.aggregation == Aggregation.seq_mean_token_sum
        ):
            raise ValueError(
                f"{prefix}token_sum_divisor={self.token_sum_divisor} divides seq_mean_token_sum's sums: it must be > 0 "
                f"(TRL's dr_grpo: max_completion_length) with {prefix}aggregation=seq_mean_token_sum, or null"
            )


@dataclass
class LossContext:
    """Everything a policy loss needs besides the tensors: the loss section as configured, the
    whole-batch denominators and this step's eps; built by the loss head per micro-batch."""

    loss: LossConfig
    global_num_sequences: Count = None  # sequences with >= 1 valid token, whole batch; None: local
    global_num_tokens: Count = None  # valid tokens, whole batch; None: local
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] = field(default=local_sequence_sum)
    clip: tuple[float, float] | None = None  # this step's (eps_low, eps_high) (adaptive clip); None: configured

    def __post_init__(self) -> None:
        if self.clip is not None:
            check_loss_settings(self.loss.aggregation, *self.clip, self.loss.log_ratio_clamp)

    @property
    def clip_low(self) -> float:
        return self.loss.clip_low if self.clip is None else self.clip[0]

    @property
    def clip_high(self) -> float:
        return self.loss.clip_high if self.clip is None else self.clip[1]

    def clamp_sequence_log_ratio(self, log_s: torch.Tensor) -> torch.Tensor:
        """log s_i bounded to [-log_ratio_clamp, gspo_log_ratio_max or log_ratio_clamp]."""
        loss = self.loss
        upper = loss.log_ratio_clamp if loss.gspo_log_ratio_max is None else loss.gspo_log_ratio_max
        return log_s.clamp(-loss.log_ratio_clamp, upper)


def check_loss_settings(
    aggregation: str, clip_low: float, clip_high: float, log_ratio_clamp: float, prefix: str = ""
) -> None:
    """The rules on a loss's settings, written once (``prefix`` names the config section in errors)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"{prefix}aggregation={aggregation!r} is unknown; valid: {', '.join(AGGREGATIONS)}")
    if not 0 <= clip_low < 1:
        raise ValueError(f"{prefix}clip_low must be in [0, 1) (the ratio floor is 1 - clip_low), got {clip_low}")
    if not clip_high >= 0:
        raise ValueError(f"{prefix}clip_high must be >= 0, got {clip_high}")
    if not log_ratio_clamp > 0:
        raise ValueError(f"{prefix}log_ratio_clamp must be > 0, got {log_ratio_clamp}")


def check_clip_extensions(clip_ratio_c: float | None, gspo_log_ratio_max: float | None, prefix: str = "") -> None:
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(
            f"{prefix}clip_ratio_c={clip_ratio_c}: the dual-clip floor c A (A < 0) needs c > 1 (verl's default "
            "is 3); set null to turn dual clip off"
        )
    if gspo_log_ratio_max is not None and not gspo_log_ratio_max > 0:
        raise ValueError(
            f"{prefix}gspo_log_ratio_max={gspo_log_ratio_max} must be > 0 (verl uses 10) or null (log_ratio_clamp)"
        )


def check_sequence_aggregation(loss_name: str, aggregation: str, prefix: str = "") -> None:
    """GSPO's ratio s_i is already length-normalised per sequence: weighting sequences by their token
    counts would re-introduce the length bias GSPO removes."""
    if aggregation not in SEQUENCE_LEVEL_AGGREGATIONS:
        raise ValueError(
            f"{prefix}name={loss_name!r} with aggregation={aggregation!r}: GSPO's ratio is already "
            f"length-normalised per sequence, so token-weighted aggregation re-introduces the length bias; "
            f"set {prefix}aggregation=seq_mean_token_mean (or use the grpo loss)"
        )


CLIP_UNITS = ("token", "seq")  # a clip fraction's unit: the share of tokens, the share of sequences


def clip_fraction_name(unit: str, side: str | None = None) -> str:
    """``clip_frac_token_low`` (one side), or the headline ``clip_frac_token`` (low + high)."""
    return f"clip_frac_{unit}" if side is None else f"clip_frac_{unit}_{side}"


@dataclass(frozen=True)
class ClipShares:
    """One clip side's share of the tokens and of the sequences, as additive sums and counts."""

    token_sum: torch.Tensor
    token_count: torch.Tensor
    seq_sum: torch.Tensor
    seq_count: torch.Tensor


@dataclass(frozen=True)
class ClipSides:
    """What every loss reports of its clipping: the low and high sides (dual with dual clip). A field, not
    a dict key, so a new loss cannot leave out the headline fractions the run log and adaptive clipping
    read (``headline_clip_fractions``)."""

    low: ClipShares
    high: ClipShares
    dual: ClipShares | None = None

    def entries(self) -> dict[str, torch.Tensor]:
        """Additive metric entries, ``clip_frac_{token,seq}_{side}/{sum,count}``, side by side."""
        entries: dict[str, torch.Tensor] = {}
        for side, shares in (("low", self.low), ("high", self.high), ("dual", self.dual)):
            if shares is not None:
                entries.update(mean_entries(clip_fraction_name("token", side), shares.token_sum, shares.token_count))
                entries.update(mean_entries(clip_fraction_name("seq", side), shares.seq_sum, shares.seq_count))
        return entries


def headline_clip_fractions(finalized: Mapping[str, float], prefix: str = "") -> dict[str, float]:
    """``clip_frac_token`` and ``clip_frac_seq``: low + high of the finalized means (``prefix`` as logged)."""
    return {
        prefix + clip_fraction_name(unit): finalized[prefix + clip_fraction_name(unit, "low")]
        + finalized[prefix + clip_fraction_name(unit, "high")]
        for unit in CLIP_UNITS
    }


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # scalar, to minimise; this micro-batch's share of the whole-batch loss
    metrics: dict[str, torch.Tensor]  # additive entries, see metrics.py; the clip fractions' among them
    clip_sides: ClipSides

    def __post_init__(self) -> None:
        missing = sorted(set(self.clip_sides.entries()) - set(self.metrics))
        if missing:
            raise ValueError(f"a policy loss's metrics leave out its clip fractions' entries {missing}")


POLICY_LOSSES: Registry[Callable[..., PolicyLossOutput]] = Registry("policy loss")


def get_policy_loss(name: str) -> Callable[..., PolicyLossOutput]:
    return POLICY_LOSSES.get(name)


@dataclass
class _Batch:
    """Validated inputs plus the per-sequence quantities every loss needs."""

    mask: torch.Tensor  # bool [B, T]
    log_ratio: torch.Tensor  # [B, T], logp - old_logp at valid tokens, 0 elsewhere (unclamped)
    lengths: torch.Tensor  # [B] whole-sequence valid-token counts (through ctx.sequence_sum)
    seq_valid: torch.Tensor  # bool [B], sequences with >= 1 valid token
    num_sequences: torch.Tensor  # denominators
    num_tokens: torch.Tensor


def _mask_and_counts(
    response_mask: torch.Tensor, ctx: LossContext, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bool mask, whole-sequence lengths [B], valid sequences [B], N_seq, N_tok) of ``response_mask``."""
    mask = response_mask.bool()
    with torch.no_grad():
        lengths = ctx.sequence_sum(mask.to(dtype))
    seq_valid = lengths > 0
    num_sequences = _denominator(ctx.global_num_sequences, seq_valid.sum())
    num_tokens = _denominator(ctx.global_num_tokens, lengths.sum())
    return mask, lengths, seq_valid, num_sequences, num_tokens


def aggregate_tokens(per_token: torch.Tensor, response_mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    """This micro-batch's share of the whole-batch mean of a per-token term [B, T], aggregated like the
    policy loss (``ctx.loss.aggregation``, global denominators); for regularisers such as KL and entropy."""
    if per_token.shape != response_mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and response_mask {tuple(response_mask.shape)} differ")
    mask, lengths, seq_valid, num_sequences, num_tokens = _mask_and_counts(response_mask, ctx, per_token.dtype)
    empty = torch.zeros_like(per_token)
    batch = _Batch(mask, empty, lengths, seq_valid, num_sequences, num_tokens)
    return _aggregate_tokens(per_token, batch, ctx)


def _prepare(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ctx: LossContext,
) -> _Batch:
    if log_probs.dim() != 2 or old_log_probs.shape != log_probs.shape or response_mask.shape != log_probs.shape:
        raise ValueError(
            f"log_probs, old_log_probs and response_mask must all be [B, T]; got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(response_mask.shape)}"
        )
    if advantages.shape not in (log_probs.shape[:1], log_probs.shape):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(log_probs.shape)}, got {tuple(advantages.shape)}")
    mask, lengths, seq_valid, num_sequences, num_tokens = _mask_and_counts(response_mask, ctx, log_probs.dtype)
    log_ratio = torch.where(mask, log_probs - old_log_probs.detach(), 0.0)
    return _Batch(mask, log_ratio, lengths, seq_valid, num_sequences, num_tokens)


def _denominator(global_count: Count, local_count: torch.Tensor) -> torch.Tensor:
    count = local_count if global_count is None else torch.as_tensor(global_count, device=local_count.device)
    return count.detach().float().clamp_min(1.0)  # an empty batch contributes 0, not NaN


def _clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, ctx: LossContext
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), floored at c A where A < 0 with dual clip;
    and where each clip is active (low, high, dual)."""
    objective = torch.minimum(ratio * advantages, ratio.clamp(1 - ctx.clip_low, 1 + ctx.clip_high) * advantages)
    clipped_high = (advantages > 0) & (ratio > 1 + ctx.clip_high)
    clipped_low = (advantages < 0) & (ratio < 1 - ctx.clip_low)
    clipped_dual = torch.zeros_like(clipped_low)
    if ctx.loss.clip_ratio_c is not None:
        floor = ctx.loss.clip_ratio_c * advantages
        # J = max(min(r A, clip(r) A), c A) for A < 0: constant c A (no gradient) where r > c
        objective = torch.where(advantages < 0, torch.maximum(objective, floor), objective)
        clipped_dual = (advantages < 0) & (ratio > ctx.loss.clip_ratio_c)
    return objective, clipped_low, clipped_high, clipped_dual


def _aggregate_tokens(per_token: torch.Tensor, batch: _Batch, ctx: LossContext) -> torch.Tensor:
    """Sum a per-token objective [B, T] into this micro-batch's share of the whole-batch mean."""
    seq_sums = ctx.sequence_sum(torch.where(batch.mask, per_token, 0.0))  # sum_t, whole sequence
    if ctx.loss.aggregation == Aggregation.seq_mean_token_mean:  # (1/N_seq) sum_i (1/|y_i|) sum_t
        return (seq_sums / batch.lengths.clamp_min(1)).sum() / batch.num_sequences
    if ctx.loss.aggregation == Aggregation.token_mean:  # (1/N_tok) sum_i sum_t
        return seq_sums.sum() / batch.num_tokens
    divisor = ctx.loss.token_sum_divisor or 1.0  # seq_mean_token_sum: (1/N_seq) sum_i sum_t / divisor
    return seq_sums.sum() / batch.num_sequences / divisor


def _sequence_log_ratio(batch: _Batch, ctx: LossContext) -> torch.Tensor:
    """log s_i = (1/|y_i|) sum_t (log pi_theta - log pi_old)(y_{i,t}), summed over the whole sequence."""
    return ctx.sequence_sum(batch.log_ratio) / batch.lengths.clamp_min(1)


def _common_metrics(batch: _Batch, ctx: LossContext) -> dict[str, torch.Tensor]:
    """KL(old || new) estimates per token and response-length statistics."""
    with torch.no_grad():
        log_r = batch.log_ratio.detach().clamp(-ctx.loss.log_ratio_clamp, ctx.loss.log_ratio_clamp)
        k1 = -log_r  # log pi_old - log pi_theta
        k3 = torch.expm1(log_r) - log_r  # (r - 1) - log r >= 0
        valid_lengths = torch.where(batch.seq_valid, batch.lengths, 0.0)
        metrics = {
            **mean_entries(
                "approx_kl_k1", ctx.sequence_sum(torch.where(batch.mask, k1, 0.0)).sum(), batch.lengths.sum()
            ),
            **mean_entries(
                "approx_kl_k3", ctx.sequence_sum(torch.where(batch.mask, k3, 0.0)).sum(), batch.lengths.sum()
            ),
            **mean_entries("response_length", valid_lengths.sum(), batch.seq_valid.sum()),
            **extremum_entries("response_length", batch.lengths, batch.seq_valid),
            **ratio_dispersion_metrics(
                batch.log_ratio, batch.mask, batch.lengths, ctx.sequence_sum, ctx.loss.log_ratio_clamp
            ),
        }
    return metrics


def _clip_fractions_per_sequence(clipped: Sequence[torch.Tensor], batch: _Batch, ctx: LossContext) -> ClipSides:
    """Clip fractions when clipping is decided per sequence ([B] indicators low, high, dual), as GSPO does."""
    shares = []
    with torch.no_grad():
        for indicator in clipped[: _clip_sides(ctx)]:  # no dual side without dual clip
            selected = indicator & batch.seq_valid
            tokens = (selected * batch.lengths).sum()
            shares.append(ClipShares(tokens, batch.lengths.sum(), selected.sum(), batch.seq_valid.sum()))
    return ClipSides(*shares)


def _clip_sides(ctx: LossContext) -> int:
    """The clip sides a loss reports: low and high, plus dual when dual clip is on."""
    return 2 if ctx.loss.clip_ratio_c is None else 3


def _clip_fractions_per_token(clipped: Sequence[torch.Tensor], batch: _Batch, ctx: LossContext) -> ClipSides:
    """Clip fractions when clipping is decided per token ([B, T] indicators low, high, dual)."""
    shares = []
    with torch.no_grad():
        for indicator in clipped[: _clip_sides(ctx)]:  # no dual side without dual clip
            per_seq = ctx.sequence_sum((indicator & batch.mask).float())  # clipped tokens per sequence
            seq_fraction = torch.where(batch.seq_valid, per_seq / batch.lengths.clamp_min(1), 0.0)
            shares.append(ClipShares(per_seq.sum(), batch.lengths.sum(), seq_fraction.sum(), batch.seq_valid.sum()))
    return ClipSides(*shares)


def _ratio_metrics(ratio: torch.Tensor, select: torch.Tensor, ctx: LossContext) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        ratio = ratio.detach()
        if ratio.dim() == 2:  # per token: sums through the sequence reducer (CP-complete)
            total = ctx.sequence_sum(torch.where(select, ratio, 0.0)).sum()
            count = ctx.sequence_sum(select.float()).sum()
        else:
            total, count = torch.where(select, ratio, 0.0).sum(), select.sum()
        return {**mean_entries("ratio", total, count), **extremum_entries("ratio", ratio, select)}


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ctx: LossContext,
) -> PolicyLossOutput:
    """GSPO (arXiv 2507.18071): one clipped, length-normalised importance ratio per sequence.

    s_i = exp( clamp( (1/|y_i|) sum_t log(pi_theta / pi_old)(y_{i,t}) ) )
    J   = (1/N_seq) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i);  loss = -J
    """
    check_sequence_aggregation("gspo", ctx.loss.aggregation)
    if advantages.dim() != 1:
        raise ValueError(
            f"gspo needs one advantage per sequence ([B]), got {tuple(advantages.shape)}; "
            f"for per-token advantages use loss 'gspo_token'"
        )
    batch = _prepare(log_probs, old_log_probs, advantages, response_mask, ctx)
    log_s = ctx.clamp_sequence_log_ratio(_sequence_log_ratio(batch, ctx))
    s = log_s.exp()
    objective, *clipped = _clipped_objective(s, advantages.detach(), ctx)
    loss = -torch.where(batch.seq_valid, objective, 0.0).sum() / batch.num_sequences
    clip = _clip_fractions_per_sequence(clipped, batch, ctx)
    metrics = {
        **_common_metrics(batch, ctx),
        **clip.entries(),
        **_ratio_metrics(s, batch.seq_valid, ctx),
    }
    return PolicyLossOutput(loss, metrics, clip)


@POLICY_LOSSES.register("gspo_token")
def gspo_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ctx: LossContext,
) -> PolicyLossOutput:
    """GSPO-token (arXiv 2507.18071, sec. 4.3): GSPO's ratio value with per-token advantages.

        log s_{i,t} = sg[log s_i] + log pi_theta(y_{i,t}) - sg[log pi_theta(y_{i,t})]
        J = (1/N_seq) sum_i (1/|y_i|) sum_t min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})
    With A_{i,t} = A_i this equals GSPO in value and gradient. Where GSPO's clamp of log s_i is active
    (its gradient is zero there) the token term is gated off too, so the equality holds everywhere.
    """
    check_sequence_aggregation("gspo_token", ctx.loss.aggregation)
    batch = _prepare(log_probs, old_log_probs, advantages, response_mask, ctx)
    seq_log_ratio = _sequence_log_ratio(batch, ctx).detach()
    log_s = ctx.clamp_sequence_log_ratio(seq_log_ratio)
    inside_clamp = (log_s == seq_log_ratio).unsqueeze(-1)
    token_grad_carrier = torch.where(batch.mask & inside_clamp, log_probs - log_probs.detach(), 0.0)
    s_token = (log_s.unsqueeze(-1) + token_grad_carrier).exp()
    token_advantages = advantages.detach() if advantages.dim() == 2 else advantages.detach().unsqueeze(-1)
    objective, *clipped = _clipped_objective(s_token, token_advantages, ctx)
    loss = -_aggregate_tokens(objective, batch, ctx)
    clip = _clip_fractions_per_token(clipped, batch, ctx)
    metrics = {
        **_common_metrics(batch, ctx),
        **clip.entries(),
        **_ratio_metrics(log_s.exp(), batch.seq_valid, ctx),
    }
    return PolicyLossOutput(loss, metrics, clip)


@POLICY_LOSSES.register("grpo")
def grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ctx: LossContext,
) -> PolicyLossOutput:
    """GRPO (arXiv 2402.03300) with asymmetric (clip-higher) PPO clipping on every token.

        w_{i,t} = exp( clamp( log pi_theta(y_{i,t}) - log pi_old(y_{i,t}) ) )
        J = aggregate_{i,t} min(w_{i,t} A_{i,t}, clip(w_{i,t}, 1 - eps_low, 1 + eps_high) A_{i,t})
    with ``ctx.loss.aggregation`` choosing the sequence-mean of token-means (the paper's form), the global
    token mean, or the sequence-mean of token sums.
    """
    batch = _prepare(log_probs, old_log_probs, advantages, response_mask, ctx)
    w = batch.log_ratio.clamp(-ctx.loss.log_ratio_clamp, ctx.loss.log_ratio_clamp).exp()
    token_advantages = advantages.detach() if advantages.dim() == 2 else advantages.detach().unsqueeze(-1)
    objective, *clipped = _clipped_objective(w, token_advantages, ctx)
    loss = -_aggregate_tokens(objective, batch, ctx)
    clip = _clip_fractions_per_token(clipped, batch, ctx)
    metrics = {
        **_common_metrics(batch, ctx),
        **clip.entries(),
        **_ratio_metrics(w, batch.mask, ctx),
    }
    return PolicyLossOutput(loss, metrics, clip)
