"""Truncated / masked importance weights pi_old / pi_rollout, by hand."""

import math

import pytest
import torch

from gspo_megatron.algorithms.config import AlgorithmConfig, MismatchConfig
from gspo_megatron.algorithms.losses import LossConfig, LossContext, get_policy_loss
from gspo_megatron.algorithms.mismatch_correction import mismatch_weights, weighted_advantages

# row 0: rho = [3, 1/2, 1] on 3 valid tokens; row 1: rho = [4, (masked: e^30)] on 1 valid token
LOG_RHO = torch.tensor([[math.log(3), math.log(0.5), 0.0], [math.log(4), 30.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ROLLOUT = torch.full((2, 3), -2.0)
OLD = ROLLOUT + LOG_RHO


def test_token_truncate_and_mask_by_hand():
    w, m = mismatch_weights(OLD, ROLLOUT, MASK, "token_truncate", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0], [2.0, 0.0, 0.0]]))
    assert m["mismatch_is/truncated_frac"].item() == pytest.approx(2 / 4)
    assert m["mismatch_is/weight_mean"].item() == pytest.approx(5.5 / 4)
    assert m["mismatch_is/ratio_mean"].item() == pytest.approx(8.5 / 4)
    assert (m["mismatch_is/weight_min"].item(), m["mismatch_is/weight_max"].item()) == (0.5, 2.0)
    w, m = mismatch_weights(OLD, ROLLOUT, MASK, "token_mask", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.0, 0.0]]))
    assert m["mismatch_is/masked_frac"].item() == pytest.approx(2 / 4)


def test_sequence_forms_are_length_normalised():
    # row 0: rho_0 = (3 * 1/2 * 1)^(1/3) = 1.5^(1/3) ~ 1.145 (kept); row 1: rho_1 = 4 (one token)
    w, m = mismatch_weights(OLD, ROLLOUT, MASK, "sequence_truncate", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([1.5 ** (1 / 3), 2.0]))
    assert m["mismatch_is/truncated_frac"].item() == pytest.approx(0.5)
    w, _ = mismatch_weights(OLD, ROLLOUT, MASK, "sequence_mask", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([1.5 ** (1 / 3), 0.0]))


def test_product_sequence_ratio_multiplies_the_token_ratios():
    """verl rollout_is=sequence / TRL sequence_*: rho_i = prod_t rho_{i,t} (row 0: 3 x 1/2 x 1 = 1.5)."""
    w, m = mismatch_weights(OLD, ROLLOUT, MASK, "sequence_truncate", cap=2.0, sequence_ratio="product")
    torch.testing.assert_close(w, torch.tensor([1.5, 2.0]))  # row 1: rho 4 capped at 2
    assert float(m["mismatch_is/ratio_mean"]) == pytest.approx((1.5 + 4) / 2)
    w, _ = mismatch_weights(OLD, ROLLOUT, MASK, "sequence_mask", cap=2.0, sequence_ratio="product")
    torch.testing.assert_close(w, torch.tensor([1.5, 0.0]))
    geometric, _ = mismatch_weights(OLD, ROLLOUT, MASK, "sequence_truncate", cap=2.0)
    assert float(geometric[0]) == pytest.approx(1.5 ** (1 / 3))


def test_weights_fold_into_the_advantage_exactly():
    """grpo with A * w equals sum over tokens of w * min(rA, clip(r)A), computed by hand."""
    log_probs = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -1.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.9, -0.5], [-1.0, -1.0, -3.0]])
    advantages = torch.tensor([1.0, -2.0])
    w, _ = mismatch_weights(OLD, ROLLOUT, MASK, "token_truncate", cap=2.0)
    ctx = LossContext(LossConfig(name="grpo", clip_low=0.2, clip_high=0.28))
    loss = get_policy_loss("grpo")(log_probs, old, weighted_advantages(advantages, w), MASK, ctx).loss
    r = (log_probs - old).exp()
    a = advantages.unsqueeze(-1)
    per_token = w * torch.minimum(r * a, r.clamp(0.8, 1.28) * a)
    expected = -((per_token * MASK).sum(1) / MASK.sum(1)).mean()
    torch.testing.assert_close(loss, expected)


def test_sequence_weights_scale_per_token_advantages_by_row_when_rows_equal_tokens():
    """Issue 29: [B, T] advantages times [B] sequence weights multiplied along T when B == T."""
    advantages = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # B = T = 2
    weights = torch.tensor([10.0, 0.5])  # row 0 x 10, row 1 x 0.5
    expected = torch.tensor([[10.0, 20.0], [1.5, 2.0]])
    assert torch.equal(weighted_advantages(advantages, weights), expected)
    assert torch.equal(weighted_advantages(torch.tensor([1.0, 3.0]), weights), torch.tensor([10.0, 1.5]))
    token_weights = torch.tensor([[1.0, 0.0], [2.0, 1.0]])
    assert torch.equal(
        weighted_advantages(torch.tensor([1.0, 3.0]), token_weights), torch.tensor([[1.0, 0.0], [6.0, 3.0]])
    )
    assert torch.equal(weighted_advantages(advantages, token_weights), torch.tensor([[1.0, 0.0], [6.0, 4.0]]))


def test_config_rejects_token_weights_for_gspo_and_a_cap_below_one():
    with pytest.raises(ValueError, match="use sequence_truncate/sequence_mask with gspo"):
        AlgorithmConfig(mismatch=MismatchConfig(correction="token_truncate"))
    with pytest.raises(ValueError, match="algorithm.mismatch.cap must be >= 1"):
        MismatchConfig(correction="sequence_mask", cap=0.5)
    with pytest.raises(ValueError, match="algorithm.mismatch.correction='tis' is unknown"):
        MismatchConfig(correction="tis")
    AlgorithmConfig(loss=LossConfig(name="grpo", clip_low=0.2, clip_high=0.28), mismatch=MismatchConfig("token_mask"))


def test_config_rejects_knobs_nothing_reads():
    with pytest.raises(ValueError, match="algorithm.mismatch.sequence_ratio=product combines"):
        MismatchConfig(correction="token_truncate", sequence_ratio="product")
    with pytest.raises(ValueError, match="algorithm.mismatch.rejected=drop removes the tokens a mask mode rejects"):
        MismatchConfig(correction="sequence_truncate", rejected="drop")
    MismatchConfig(correction="sequence_mask", sequence_ratio="product", rejected="drop")
