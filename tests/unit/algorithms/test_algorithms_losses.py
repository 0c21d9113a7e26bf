"""Policy losses: hand-computed values/grads, clip boundaries, masks, GSPO-token == GSPO, on-policy
REINFORCE, and micro-batch splitting with global denominators."""

import math

import pytest
import torch

from gspo_megatron.algorithms import LossConfig, LossContext, finalize_metrics, get_policy_loss, merge_metrics

NAN = float("nan")

# Two sequences, T = 3. Seq 0 has 2 valid tokens (last is padding), seq 1 has 3.
# log ratios (logp - old): seq 0 [0.1, -0.3, pad], seq 1 [0.3, 0.0, 0.3].
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
OLD = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -1.5, -2.5]])  # NaN at padding must not leak
LOG_RATIO = torch.tensor([[0.1, -0.3, 0.0], [0.3, 0.0, 0.3]])


def _log_probs():
    return (torch.nan_to_num(OLD, nan=0.0) + LOG_RATIO).requires_grad_()


def _ctx(
    clip_low,
    clip_high,
    aggregation="seq_mean_token_mean",
    *,
    global_num_sequences=None,
    global_num_tokens=None,
    **settings,
):
    """A context whose settings validate as GRPO's (any aggregation), so what a test sees of GSPO's
    aggregation rule is the loss function's own check."""
    loss = LossConfig(name="grpo", clip_low=clip_low, clip_high=clip_high, aggregation=aggregation, **settings)
    return LossContext(loss, global_num_sequences=global_num_sequences, global_num_tokens=global_num_tokens)


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


def test_gspo_hand_computed_unclipped_value_and_grad():
    # s_0 = exp((0.1 - 0.3) / 2) = e^-0.1, s_1 = exp(0.6 / 3) = e^0.2; both inside [0.8, 1.28].
    log_probs = _log_probs()
    advantages = torch.tensor([1.0, -0.5])
    out = get_policy_loss("gspo")(log_probs, OLD, advantages, MASK, _ctx(0.2, 0.28))
    s0, s1 = math.exp(-0.1), math.exp(0.2)
    _close(out.loss, -(s0 * 1.0 + s1 * -0.5) / 2)  # -J, J = mean_i s_i A_i
    out.loss.backward()
    # d loss / d logp_{i,t} = -(1/N) A_i s_i / |y_i| on valid tokens, 0 at padding
    g0, g1 = -(1.0 * s0 / 2) / 2, -(-0.5 * s1 / 3) / 2
    _close(log_probs.grad, [[g0, g0, 0.0], [g1, g1, g1]])
    metrics = finalize_metrics(out.metrics)
    _close(metrics["ratio"], (s0 + s1) / 2)
    _close(metrics["ratio/min"], s0)
    _close(metrics["ratio/max"], s1)
    _close(metrics["response_length"], 2.5)
    _close(metrics["clip_frac_seq_low"], 0.0)
    _close(metrics["approx_kl_k1"], -0.4 / 5)  # mean of -(logp - old) over 5 tokens
    k3 = sum(math.expm1(x) - x for x in (0.1, -0.3, 0.3, 0.0, 0.3)) / 5
    _close(metrics["approx_kl_k3"], k3)


def test_gspo_clip_low_and_high_are_active_and_zero_the_gradient():
    # clip [0.95, 1.1]: s_0 = 0.905 < 0.95 with A < 0 -> clipped low; s_1 = 1.221 > 1.1 with A > 0 -> high.
    log_probs = _log_probs()
    out = get_policy_loss("gspo")(log_probs, OLD, torch.tensor([-1.0, 0.5]), MASK, _ctx(0.05, 0.1))
    _close(out.loss, -(-0.95 + 0.5 * 1.1) / 2)
    out.loss.backward()
    assert torch.all(log_probs.grad == 0)
    metrics = finalize_metrics(out.metrics)
    _close(metrics["clip_frac_seq_low"], 0.5)
    _close(metrics["clip_frac_seq_high"], 0.5)
    _close(metrics["clip_frac_token_low"], 2 / 5)  # the 2 tokens of sequence 0
    _close(metrics["clip_frac_token_high"], 3 / 5)


def test_gspo_ratio_beyond_clip_on_the_other_side_of_the_advantage_is_not_clipped():
    # s_0 = 0.905 < 0.95 but A_0 > 0: min picks the unclipped term; the gradient flows.
    log_probs = _log_probs()
    out = get_policy_loss("gspo")(log_probs, OLD, torch.tensor([1.0, -0.5]), MASK, _ctx(0.05, 0.1))
    _close(out.loss, -(math.exp(-0.1) * 1.0 + math.exp(0.2) * -0.5) / 2)
    out.loss.backward()
    assert torch.all(log_probs.grad[MASK] != 0)
    assert finalize_metrics(out.metrics)["clip_frac_seq_low"] == 0


@pytest.mark.parametrize("loss_name", ["gspo", "grpo"])
def test_exact_clip_boundaries(loss_name):
    # A single token whose ratio sits just inside / just outside 1 + eps_high (A > 0) and 1 - eps_low (A < 0).
    eps_low, eps_high, delta = 0.2, 0.28, 1e-4
    cases = [  # (log ratio, advantage, gradient expected non-zero)
        (math.log(1 + eps_high) - delta, 1.0, True),
        (math.log(1 + eps_high) + delta, 1.0, False),
        (math.log(1 - eps_low) + delta, -1.0, True),
        (math.log(1 - eps_low) - delta, -1.0, False),
    ]
    for log_ratio, advantage, flows in cases:
        log_probs = torch.tensor([[log_ratio]], requires_grad=True)
        out = get_policy_loss(loss_name)(
            log_probs,
            torch.zeros(1, 1),
            torch.tensor([advantage]),
            torch.ones(1, 1, dtype=torch.bool),
            _ctx(eps_low, eps_high),
        )
        out.loss.backward()
        assert (log_probs.grad.abs().item() > 0) == flows, (log_ratio, advantage)
        clipped = 1 - flows
        side = "high" if advantage > 0 else "low"
        assert finalize_metrics(out.metrics)[f"clip_frac_token_{side}"].item() == clipped


GRPO_EXPECTED = {  # A = [-1, 0.5], clip [0.8, 1.28]; token objectives:
    # seq 0: w = e^0.1 -> -1.105171 (inside); w = e^-0.3 = 0.7408 < 0.8 with A < 0 -> clipped: -0.8
    # seq 1: w = e^0.3 = 1.3499 > 1.28 with A > 0 -> clipped: 0.64; w = 1 -> 0.5; e^0.3 -> 0.64
    "seq_mean_token_mean": -((-math.exp(0.1) - 0.8) / 2 + (0.64 + 0.5 + 0.64) / 3) / 2,
    "token_mean": -((-math.exp(0.1) - 0.8) + (0.64 + 0.5 + 0.64)) / 5,
    "seq_mean_token_sum": -((-math.exp(0.1) - 0.8) + (0.64 + 0.5 + 0.64)) / 2,
}
GRPO_GRAD_SCALE = {  # d loss / d w-term for tokens (0,0) and (1,1): -A * w * weight of the token
    "seq_mean_token_mean": (1 / 4, 1 / 6),
    "token_mean": (1 / 5, 1 / 5),
    "seq_mean_token_sum": (1 / 2, 1 / 2),
}


@pytest.mark.parametrize("aggregation", list(GRPO_EXPECTED))
def test_grpo_hand_computed_every_aggregation(aggregation):
    log_probs = _log_probs()
    out = get_policy_loss("grpo")(log_probs, OLD, torch.tensor([-1.0, 0.5]), MASK, _ctx(0.2, 0.28, aggregation))
    _close(out.loss, GRPO_EXPECTED[aggregation])
    out.loss.backward()
    weight_00, weight_11 = GRPO_GRAD_SCALE[aggregation]
    expected_grad = torch.zeros(2, 3)
    expected_grad[0, 0] = 1.0 * math.exp(0.1) * weight_00  # -(A = -1) * ratio  # only unclipped tokens get gradient
    expected_grad[1, 1] = -(0.5) * 1.0 * weight_11
    _close(log_probs.grad, expected_grad)
    metrics = finalize_metrics(out.metrics)
    _close(metrics["clip_frac_token_low"], 1 / 5)
    _close(metrics["clip_frac_token_high"], 2 / 5)
    _close(metrics["clip_frac_seq_low"], (1 / 2 + 0) / 2)
    _close(metrics["clip_frac_seq_high"], (0 + 2 / 3) / 2)
    ratios = [math.exp(0.1), math.exp(-0.3), math.exp(0.3), 1.0, math.exp(0.3)]
    _close(metrics["ratio"], sum(ratios) / 5)
    _close(metrics["ratio/min"], math.exp(-0.3))
    _close(metrics["ratio/max"], math.exp(0.3))


def test_gspo_rejects_token_weighted_aggregations_and_token_advantages():
    for name in ("gspo", "gspo_token"):
        for aggregation in ("token_mean", "seq_mean_token_sum"):
            with pytest.raises(ValueError, match="length bias"):
                get_policy_loss(name)(_log_probs(), OLD, torch.ones(2), MASK, _ctx(0.2, 0.28, aggregation))
    with pytest.raises(ValueError, match="use loss 'gspo_token'"):
        get_policy_loss("gspo")(_log_probs(), OLD, torch.ones(2, 3), MASK, _ctx(0.2, 0.28))


def _random_batch(batch=6, length=7, scale=0.05, seed=1):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen) * 3
    log_probs = (old + scale * torch.randn(batch, length, generator=gen)).requires_grad_()
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[2] = 0  # a fully padded row contributes nothing
    mask = torch.arange(length) < lengths.unsqueeze(-1)
    advantages = torch.randn(batch, generator=gen)
    return log_probs, old, advantages, mask


def test_gspo_token_equals_gspo_in_value_and_gradient_with_sequence_constant_advantage():
    log_probs, old, advantages, mask = _random_batch(scale=0.2)
    ctx = _ctx(0.02, 0.03)  # tight enough that some sequences clip, some not
    gspo = get_policy_loss("gspo")(log_probs, old, advantages, mask, ctx)
    (gspo_grad,) = torch.autograd.grad(gspo.loss, log_probs)
    assert (
        0
        < finalize_metrics(gspo.metrics)["clip_frac_seq_high"] + finalize_metrics(gspo.metrics)["clip_frac_seq_low"]
        < 1
    )
    for token_advantages in (advantages, advantages.unsqueeze(-1).expand_as(mask)):
        token = get_policy_loss("gspo_token")(log_probs, old, token_advantages, mask, ctx)
        (token_grad,) = torch.autograd.grad(token.loss, log_probs)
        torch.testing.assert_close(token.loss, gspo.loss)
        torch.testing.assert_close(token_grad, gspo_grad)
        assert token_grad.abs().sum() > 0


def test_on_policy_gspo_gradient_is_sequence_mean_reinforce():
    # Parametrise through real logits so the gradient reaches model outputs, not just log-probs.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 11, generator=gen, requires_grad=True)
    tokens = torch.randint(0, 11, (4, 5), generator=gen)
    mask = torch.arange(5) < torch.tensor([5, 2, 4, 1]).unsqueeze(-1)
    advantages = torch.tensor([1.0, -2.0, 0.5, 3.0])
    log_probs = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    out = get_policy_loss("gspo")(log_probs, log_probs.detach(), advantages, mask, _ctx(3e-4, 4e-4))
    (grad,) = torch.autograd.grad(out.loss, logits, retain_graph=True)
    # REINFORCE with a sequence-mean of log-likelihood: -(1/N) sum_i A_i (1/|y_i|) sum_t log pi
    reinforce = -(advantages * (log_probs * mask).sum(-1) / mask.sum(-1)).mean()
    (expected,) = torch.autograd.grad(reinforce, logits)
    torch.testing.assert_close(grad, expected)
    assert finalize_metrics(out.metrics)["ratio"] == 1.0


@pytest.mark.parametrize(
    "loss_name,aggregation",
    [("gspo", "seq_mean_token_mean"), ("gspo_token", "seq_mean_token_mean")]
    + [("grpo", a) for a in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum")],
)
def test_micro_batch_split_with_global_denominators_equals_one_batch(loss_name, aggregation):
    log_probs, old, advantages, mask = _random_batch(scale=0.3)
    loss_fn = get_policy_loss(loss_name)
    whole = loss_fn(log_probs, old, advantages, mask, _ctx(0.1, 0.15, aggregation))
    (whole_grad,) = torch.autograd.grad(whole.loss, log_probs)
    num_sequences, num_tokens = (mask.sum(-1) > 0).sum(), mask.sum()
    total_loss, metrics = 0.0, None
    grads = []
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        piece = log_probs.detach()[rows].clone().requires_grad_()
        ctx = _ctx(0.1, 0.15, aggregation, global_num_sequences=num_sequences, global_num_tokens=num_tokens)
        out = loss_fn(piece, old[rows], advantages[rows], mask[rows], ctx)
        out.loss.backward()
        total_loss = total_loss + out.loss.detach()
        grads.append(piece.grad)
        metrics = merge_metrics(metrics, out.metrics)
    torch.testing.assert_close(total_loss, whole.loss.detach())
    torch.testing.assert_close(torch.cat(grads), whole_grad)
    whole_metrics, merged = finalize_metrics(whole.metrics), finalize_metrics(metrics)
    assert whole_metrics.keys() == merged.keys()
    for key in whole_metrics:
        torch.testing.assert_close(merged[key], whole_metrics[key], msg=key, equal_nan=True)  # empty length buckets


def test_log_ratio_is_clamped_before_exp():
    log_probs = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-500.0, -500.0]])  # log ratio 500 would overflow exp
    out = get_policy_loss("grpo")(
        log_probs, old, torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool), _ctx(0.2, 0.28, log_ratio_clamp=20.0)
    )
    _close(out.loss, math.exp(20.0), atol=1e-2)  # -(-1 * e^20) per token, token-mean
    assert torch.isfinite(finalize_metrics(out.metrics)["approx_kl_k3"])


def test_loss_context_validates():
    with pytest.raises(ValueError, match="valid: seq_mean_token_mean, token_mean, seq_mean_token_sum"):
        _ctx(0.2, 0.28, "mean")
    with pytest.raises(ValueError, match="clip_low"):
        _ctx(1.0, 0.28)


def test_grpo_dual_clip_floors_negative_advantages_at_c_by_hand():
    """Dual clip (arXiv 1912.09729; verl clip_ratio_c): J_t = max(min(w A, clip(w) A), c A) where A < 0.
    One sequence, token_mean, A = -1: w = [e^2, 2, 0.5] with c = 3, eps 0.2 / 0.2:
      t0: w = 7.39 > c: J = -3 (floor; no gradient)   t1: w = 2 < c: J = -2 (gradient -w = -2)
      t2: w = 0.5 < 1 - eps: clipped low: J = -0.8 (no gradient)."""
    old = torch.zeros(1, 3)
    log_probs = torch.tensor([[2.0, math.log(2.0), math.log(0.5)]], requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    advantages = torch.tensor([-1.0])
    out = get_policy_loss("grpo")(log_probs, old, advantages, mask, _ctx(0.2, 0.2, "token_mean", clip_ratio_c=3.0))
    _close(out.loss, (3.0 + 2.0 + 0.8) / 3)
    out.loss.backward()
    _close(log_probs.grad, [[0.0, 2.0 / 3, 0.0]])  # d(-J/3)/d logp_1 = -(A w)/3 = 2/3
    metrics = finalize_metrics(out.metrics)
    _close(metrics["clip_frac_token_dual"], 1 / 3)
    _close(metrics["clip_frac_token_low"], 1 / 3)
    without = get_policy_loss("grpo")(log_probs.detach(), old, advantages, mask, _ctx(0.2, 0.2, "token_mean"))
    _close(without.loss, (math.exp(2) + 2.0 + 0.8) / 3)  # no floor: e^2 enters
    assert "clip_frac_token_dual" not in finalize_metrics(without.metrics)
    positive = get_policy_loss("grpo")(
        log_probs.detach(), old, -advantages, mask, _ctx(0.2, 0.2, "token_mean", clip_ratio_c=3.0)
    )
    _close(positive.loss, -(1.2 + 1.2 + 0.5) / 3)  # A > 0: dual clip does nothing


@pytest.mark.parametrize("loss_name", ["gspo", "gspo_token"])
def test_gspo_log_ratio_max_bounds_only_the_top(loss_name):
    """gspo_log_ratio_max = 10 (verl clamps log s_i at max 10): log s = 12 -> s = e^10, no gradient;
    log s = -25 is bounded below by log_ratio_clamp (20): s = e^-20."""
    old = torch.zeros(2, 2)
    log_probs = torch.tensor([[12.0, 12.0], [-25.0, -25.0]], requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    advantages = torch.tensor([-1.0, 1.0])
    ctx = _ctx(0.2, 0.2, gspo_log_ratio_max=10.0)
    out = get_policy_loss(loss_name)(log_probs, old, advantages, mask, ctx)
    # seq 0: A < 0, s = e^10 > 1.2: min(-e^10, -1.2) = -e^10; seq 1: A > 0, s = e^-20: min(e^-20, 0.8) = e^-20
    _close(out.loss, -(-math.exp(10) + math.exp(-20)) / 2, atol=1e-3)
    out.loss.backward()
    _close(log_probs.grad, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="gspo_log_ratio_max=0.0 must be > 0"):
        _ctx(0.2, 0.2, gspo_log_ratio_max=0.0)
    with pytest.raises(ValueError, match="clip_ratio_c=1.0: the dual-clip floor"):
        _ctx(0.2, 0.2, clip_ratio_c=1.0)


def test_token_sum_divisor_is_trls_dr_grpo_normalisation_by_hand():
    """TRL loss_type="dr_grpo": sum(per_token_loss * mask) / (B * max_completion_length), per_token_loss =
    -min(r A, clip(r, 1 - eps, 1 + eps) A); ours: seq_mean_token_sum with token_sum_divisor = that length."""
    log_probs, advantages = _log_probs(), torch.tensor([-1.0, 0.5])
    ctx = _ctx(0.2, 0.28, "seq_mean_token_sum", token_sum_divisor=8.0)
    out = get_policy_loss("grpo")(log_probs, OLD, advantages, MASK, ctx)
    r, a = LOG_RATIO.exp(), advantages.unsqueeze(-1)
    per_token = -torch.minimum(r * a, r.clamp(0.8, 1.28) * a)
    _close(out.loss, (per_token * MASK).sum() / (2 * 8.0))
    undivided = get_policy_loss("grpo")(log_probs, OLD, advantages, MASK, _ctx(0.2, 0.28, "seq_mean_token_sum")).loss
    _close(out.loss, undivided / 8.0)
    with pytest.raises(ValueError, match="token_sum_divisor=8.0 divides seq_mean_token_sum's sums"):
        _ctx(0.2, 0.28, "token_mean", token_sum_divisor=8.0)
    with pytest.raises(ValueError, match="it must be > 0"):
        _ctx(0.2, 0.28, "seq_mean_token_sum", token_sum_divisor=0.0)
