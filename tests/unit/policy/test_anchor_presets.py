"""The anchor presets (conf/algorithm/verl_grpo, verl_gspo, trl_grpo, slime_gspo) against each system's
own loss, transcribed below from its source, on random inputs with padding and extreme ratios.

Our side is the trainer's path: the composed preset -> mismatch weights folded into the advantages ->
``PolicyLossHead`` (policy loss + KL + entropy, global denominators) -> loss and gradient w.r.t. the
logits. Their side recomputes the log-probs from the same logits in float64 and applies the
transcribed formula. Each test also turns the preset's distinguishing knobs back to our defaults and
checks the loss moves, so every knob is shown to matter on this batch (docs/migration.md's table
quotes those numbers).

Sources (read, not copied; transcriptions are ours):
- verl: verl-project/verl 1dda039, verl/trainer/ppo/core_algos.py compute_policy_loss_vanilla,
  compute_policy_loss_gspo, kl_penalty_forward, agg_loss; verl/workers/utils/losses.py (KL added as
  kl_loss_coef * agg_loss(kld) with the policy's loss_agg_mode).
- TRL: huggingface/trl f2cd577, trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss (loss_type
  "dapo") and the vLLM importance-sampling block of _generate_and_score_completions.
- slime: THUDM/slime 624b824, slime/utils/ppo_utils.py compute_gspo_kl, compute_policy_loss;
  slime/backends/megatron_utils/cp_utils.py get_sum_of_sample_mean; loss.py loss_function.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from gspo_megatron.algorithms.config import AlgorithmConfig
from gspo_megatron.algorithms.mismatch_correction import mismatch_weights, weighted_advantages
from gspo_megatron.config.compose import compose
from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.policy.loss_heads import PolicyLossHead

B, T, V = 6, 8, 13
LENGTHS = [8, 5, 3, 7, 2, 6]  # right padding after each row's response
ADVANTAGES = torch.tensor([1.2, -0.7, -0.9, -1.5, 0.4, 1.1], dtype=torch.float64)


def preset(name: str) -> AlgorithmConfig:
    return OmegaConf.to_object(compose([f"algorithm={name}"])).algorithm


def _inputs():
    """Logits and every per-token field, with the extremes each anchor treats specially:
    row 0 token 2: log ratio +25 (A > 0: clipped); row 1 token 1: -25; row 2: +22 on every token with
    A < 0 (token ratios past verl's +-20 clamp and dual clip; GSPO's log s_2 = 22 past verl's max 10
    and our default clamp 20, unclamped in TRL and slime); row 3: +1.5 per token with A < 0 (ratio
    4.5 > dual clip 3); row 5: -22 on every token (log s_5 = -22, below our lower bound -20). The
    reference KL has d = -20 at row 0 token 0 and +15 at row 4 token 1 (both past low_var_kl's bound
    of 10); the engine's log-probs put row 1's product ratio pi_old / pi_rollout at e^1.0 (kept by
    the cap 3) and row 4's at e^1.2 = 3.3 (masked by TRL), while their geometric means stay below 3."""
    g = torch.Generator().manual_seed(29)
    logits = 3 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T) < torch.tensor(LENGTHS).unsqueeze(-1)).double()
    log_probs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    log_ratio = 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    log_ratio[0, 2], log_ratio[1, 1], log_ratio[2], log_ratio[3], log_ratio[5] = 25.0, -25.0, 22.0, 1.5, -22.0
    old = log_probs - log_ratio  # log pi_theta - log pi_old = log_ratio
    ref_d = 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref_d[0, 0], ref_d[4, 1] = -20.0, 15.0
    engine_gap = 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    engine_gap[1], engine_gap[4] = 0.2, 0.6  # sums 1.0 (5 tokens) and 1.2 (2 tokens): e^1.0 < 3 < e^1.2
    batch = MicroBatch(
        tokens=targets,
        targets=targets,
        response_mask=mask,
        advantages=ADVANTAGES.clone(),
        old_log_probs=old,
        ref_log_probs=log_probs - ref_d,
        rollout_log_probs=old - engine_gap,
    )
    return logits, batch


def ours(cfg: AlgorithmConfig, logits: torch.Tensor, batch: MicroBatch):
    """Loss and d loss / d logits through the trainer's path (mismatch weights, then the loss head)."""
    batch = replace(batch)
    mask = batch.response_mask
    if cfg.mismatch.correction != "none":
        weights, _ = mismatch_weights(
            batch.old_log_probs,
            batch.rollout_log_probs,
            mask,
            cfg.mismatch.correction,
            cfg.mismatch.cap,
            cfg.loss.log_ratio_clamp,
            cfg.mismatch.sequence_ratio,
        )
        batch.advantages = weighted_advantages(batch.advantages, weights.double())
    head = PolicyLossHead(
        cfg,
        None,
        None,
        1.0,
        global_num_sequences=(mask.sum(-1) > 0).sum().double(),
        global_num_tokens=mask.sum(),
    )
    leaf = logits.clone().requires_grad_()
    loss, _ = head(leaf, batch)
    loss.backward()
    return loss.detach(), leaf.grad


def theirs(formula, logits: torch.Tensor, batch: MicroBatch):
    leaf = logits.clone().requires_grad_()
    log_prob = torch.log_softmax(leaf, -1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    loss = formula(log_prob, batch)
    loss.backward()
    return loss.detach(), leaf.grad


# ---------------------------------------------------------------- verl (transcribed)
def _verl_agg(loss_mat, mask, mode):
    """agg_loss with dp_size 1: token-mean = masked sum / valid tokens; seq-mean-token-mean = per-row
    masked sum / (row tokens + 1e-8), summed over rows with tokens, / global_batch_size (all rows)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq_tokens = mask.sum(-1)
    seq_losses = (loss_mat * mask).sum(-1) / (seq_tokens + 1e-8)
    return (seq_losses * (seq_tokens > 0)).sum() / mask.shape[0]


def _verl_low_var_kl(log_prob, ref_log_prob):
    """kl_penalty_forward "low_var_kl": kl = clamp(ref - logp, +-20); clamp(exp(kl) - kl - 1, +-10)."""
    kl = (ref_log_prob - log_prob).clamp(-20, 20)
    return (kl.exp() - kl - 1).clamp(-10, 10)


def verl_grpo(log_prob, batch, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0, kl_loss_coef=0.001):
    """compute_policy_loss_vanilla (loss_agg_mode token-mean) + kl_loss_coef * agg_loss(low_var_kl)."""
    mask, advantages = batch.response_mask, batch.advantages.unsqueeze(-1) * batch.response_mask
    ratio = (log_prob - batch.old_log_probs).clamp(-20.0, 20.0).exp()
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-advantages * clip_ratio_c, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    kld = _verl_low_var_kl(log_prob, batch.ref_log_probs)
    return _verl_agg(pg_losses, mask, "token-mean") + kl_loss_coef * _verl_agg(kld, mask, "token-mean")


def verl_gspo(log_prob, batch, clip_low=3e-4, clip_high=4e-4):
    """compute_policy_loss_gspo: log s_it = sg[mean_t log r] + logp - sg[logp], clamped at max 10."""
    mask, advantages = batch.response_mask, batch.advantages.unsqueeze(-1) * batch.response_mask
    negative_approx_kl = log_prob - batch.old_log_probs
    seq_lengths = mask.sum(-1).clamp(min=1)
    negative_approx_kl_seq = (negative_approx_kl * mask).sum(-1) / seq_lengths
    log_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    ratio = log_ratio.clamp(max=10.0).exp()
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    return _verl_agg(torch.maximum(pg_losses1, pg_losses2), mask, "seq-mean-token-mean")


# ---------------------------------------------------------------- TRL (transcribed)
def trl_grpo(log_prob, batch, epsilon=0.2, clip_max=3.0):
    """_compute_loss, loss_type "dapo", token-level ratio (no clamp), times the vLLM sequence_mask IS
    ratio exp(sum_t (old - sampling) * mask), zeroed above clip_max; / num_items_in_batch (tokens)."""
    mask, advantages = batch.response_mask, batch.advantages.unsqueeze(1)
    coef_1 = (log_prob - batch.old_log_probs).exp()
    coef_2 = coef_1.clamp(1 - epsilon, 1 + epsilon)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    is_ratio = ((batch.old_log_probs - batch.rollout_log_probs) * mask).sum(-1, keepdim=True).exp()
    is_ratio = is_ratio.masked_fill(is_ratio > clip_max, 0.0)
    per_token_loss = per_token_loss * is_ratio
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


# ---------------------------------------------------------------- slime (transcribed)
def slime_gspo(log_prob, batch, eps_clip=4e-4, eps_clip_high=4e-4):
    """compute_gspo_kl (per-sample mean of old - new, broadcast to tokens) -> compute_policy_loss
    (no dual clip) -> sum_of_sample_mean -> loss_function's * num_microbatches / step_global_batch_size."""
    mask, advantages = batch.response_mask, batch.advantages.unsqueeze(-1)
    ppo_kl = ((batch.old_log_probs - log_prob) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
    ratio = (-ppo_kl).exp().expand_as(log_prob)
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    sum_of_sample_mean = ((pg_losses * mask).sum(-1) / mask.sum(-1).clamp_min(1)).sum()
    return sum_of_sample_mean * 1 / mask.shape[0]


ANCHORS = {"verl_grpo": verl_grpo, "verl_gspo": verl_gspo, "trl_grpo": trl_grpo, "slime_gspo": slime_gspo}
# Our token log-probs are computed in float32 (algorithms/logprobs.py), the transcriptions in float64:
# agreement is to float32 precision, relative to the loss (and gradient) scale.
LOSS_RTOL, GRAD_RTOL = 2e-6, 1e-5


@pytest.mark.parametrize("name", sorted(ANCHORS))
def test_preset_loss_and_gradient_equal_the_anchor(name):
    """The one remaining difference on this batch sits below float32 resolution: verl bounds GSPO's
    log s_i only from above, ours also at -log_ratio_clamp = -20, so row 5 (log s = -22, A = 1.1) adds
    e^-20 A / 6 = 3.8e-10 to the loss instead of e^-22 A / 6 = 5.1e-11 (docs/migration.md, "Anchor presets")."""
    logits, batch = _inputs()
    got_loss, got_grad = ours(preset(name), logits, batch)
    want_loss, want_grad = theirs(ANCHORS[name], logits, batch)
    assert math.isfinite(float(want_loss))
    assert abs(float(got_loss - want_loss)) <= LOSS_RTOL * max(1.0, abs(float(want_loss)))
    scale = float(want_grad.abs().max())
    torch.testing.assert_close(got_grad, want_grad, rtol=GRAD_RTOL, atol=GRAD_RTOL * scale)


KNOBS = {  # preset -> the knobs (section.key) that make it that anchor, each set back to our own default
    "verl_grpo": {"loss.clip_ratio_c": None, "kl.estimator": "k3", "loss.aggregation": "seq_mean_token_mean"},
    "verl_gspo": {"loss.gspo_log_ratio_max": None},
    "trl_grpo": {"mismatch.sequence_ratio": "geometric", "loss.log_ratio_clamp": 20.0, "mismatch.correction": "none"},
    "slime_gspo": {"loss.log_ratio_clamp": 20.0},
}


def _with(cfg: AlgorithmConfig, changes: dict) -> AlgorithmConfig:
    """``cfg`` with ``{"section.key": value}`` set, each section rebuilt (and validated) once."""
    sections: dict[str, dict] = {}
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        sections.setdefault(section, {})[key] = value
    return replace(cfg, **{name: replace(getattr(cfg, name), **keys) for name, keys in sections.items()})


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_each_distinguishing_knob_changes_the_loss_on_this_batch(name):
    """Without any one of its knobs a preset no longer matches its anchor (so the test above can fail)."""
    logits, batch = _inputs()
    base = preset(name)
    want_loss, _ = theirs(ANCHORS[name], logits, batch)
    for key, default in KNOBS[name].items():
        extra = {"mismatch.sequence_ratio": "geometric"} if key == "mismatch.correction" else {}
        changed = _with(base, {key: default, **extra})
        got_loss, _ = ours(changed, logits, batch)
        assert abs(float(got_loss - want_loss)) > 100 * LOSS_RTOL * max(1.0, abs(float(want_loss))), key
