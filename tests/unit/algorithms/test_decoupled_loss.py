"""AReaL's decoupled objective (``algorithm.mismatch.correction=decoupled``): hand-computed values on a batch
whose tokens come from three weight versions, and the exact reduction to the uncorrected loss."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms.config import AlgorithmConfig, MismatchConfig
from gspo_megatron.algorithms.losses import LossConfig, LossContext, get_policy_loss
from gspo_megatron.algorithms.mismatch_correction import mismatch_weights, weighted_advantages
from gspo_megatron.contracts.batch import partition
from gspo_megatron.contracts.samples import Sample
from gspo_megatron.contracts.share import step_totals
from gspo_megatron.loop.corrections import correct_mismatch
from gspo_megatron.rollout.pack import pack_samples

# The batch trains at version 5. Row 0's tokens were sampled by versions [3, 4, 4, 5], row 1's by [4, 5, 5]
# (a padded fourth position). log pi_prox = -1 everywhere (the trainer's pass before the updates, version 5);
# the behaviour log-probs mu_{v_t} are given so that w = pi_prox / mu is, per token:
#   row 0: [1/2 (v3), 8 (v4: beyond the cap 5, masked to 0), 2 (v4), 1 (v5: mu = pi_prox)]
#   row 1: [2 (v4), 1 (v5), 1 (v5)]
VERSIONS = [[3, 4, 4, 5], [4, 5, 5, -1]]
PROXIMAL = torch.full((2, 4), -1.0)
BEHAVIOUR = PROXIMAL - torch.tensor(
    [[math.log(0.5), math.log(8.0), math.log(2.0), 0.0], [math.log(2.0), 0.0, 0.0, 0.0]]
)
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
# pi_theta / pi_prox per token; advantages +1 (row 0) and -2 (row 1)
RATIO = torch.tensor([[1.1, 0.9, 1.5, 1.0], [0.7, 1.2, 1.0, 1.0]])
ADVANTAGES = torch.tensor([1.0, -2.0])
CAP = 5.0  # AReaL's behav_imp_weight_cap


def _loss(name: str, clip: float, clip_high: float, per_row: bool) -> torch.Tensor:
    weights, _ = mismatch_weights(PROXIMAL, BEHAVIOUR, MASK, "decoupled", cap=CAP, per_row=per_row)
    log_probs = PROXIMAL + RATIO.log()
    ctx = LossContext(LossConfig(name=name, clip_low=clip, clip_high=clip_high))
    return get_policy_loss(name)(log_probs, PROXIMAL, weighted_advantages(ADVANTAGES, weights), MASK, ctx).loss


def test_the_versions_give_the_stated_weights():
    assert VERSIONS[0][1] == 4  # the masked token is a version-4 token
    weights, metrics = mismatch_weights(PROXIMAL, BEHAVIOUR, MASK, "decoupled", cap=CAP)
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.0, 2.0, 1.0], [2.0, 1.0, 1.0, 0.0]]))
    assert float(metrics["mismatch_is/masked_frac"]) == pytest.approx(1 / 7)
    row_weights, _ = mismatch_weights(PROXIMAL, BEHAVIOUR, MASK, "decoupled", cap=CAP, per_row=True)
    torch.testing.assert_close(row_weights, torch.tensor([3.5 / 4, 4.0 / 3]))


def test_grpo_token_level_by_hand():
    """J = (1/N_seq) sum_i (1/|y_i|) sum_t w_{i,t} min(r A_i, clip(r, 0.8, 1.28) A_i), the clip around pi_prox.
    row 0 (A = 1):  min terms [1.1, 0.9, 1.28 (clipped), 1.0] x w [0.5, 0, 2, 1] = [0.55, 0, 2.56, 1]: sum 4.11
    row 1 (A = -2): min terms [-1.6 (clip 0.8), -2.4, -2] x w [2, 1, 1] = [-3.2, -2.4, -2]: sum -7.6"""
    expected = -(4.11 / 4 + -7.6 / 3) / 2
    assert float(_loss("grpo", 0.2, 0.28, per_row=False)) == pytest.approx(expected, rel=1e-6)


def test_gspo_by_hand():
    """s_i = exp((1/|y_i|) sum_t log(pi_theta / pi_prox)): both factors of every token's ratio are pi_theta and
    pi_prox; the behaviour versions enter through w_i = (1/|y_i|) sum_t w_{i,t} alone. With eps 0.05:
    row 0: s_0 = (1.1 x 0.9 x 1.5 x 1)^(1/4) = 1.1039 > 1.05, A = 1: term 1.05;       w_0 = 3.5 / 4
    row 1: s_1 = (0.7 x 1.2 x 1)^(1/3) = 0.9435 < 0.95, A = -2: min(-1.887, -1.9) = -1.9; w_1 = 4 / 3"""
    assert 1.485 ** (1 / 4) > 1.05 and 0.84 ** (1 / 3) < 0.95  # the clips the hand value takes
    expected = -(3.5 / 4 * 1.05 + 4 / 3 * -1.9) / 2
    assert float(_loss("gspo", 0.05, 0.05, per_row=True)) == pytest.approx(expected, rel=1e-6)
    # gspo_token with the per-token weights: sum_t w_{i,t} x the same sequence term, as AReaL's GSPO sums it
    assert float(_loss("gspo_token", 0.05, 0.05, per_row=False)) == pytest.approx(expected, rel=1e-6)


def _batch(lengths: list[int]):
    torch.manual_seed(0)
    samples = [
        Sample(
            prompt_ids=[1, 2],
            output_ids=[5 + (i + j) % 7 for j in range(n)],
            output_log_probs=-torch.rand(n),
            finish_reason="stop",
        )
        for i, n in enumerate(lengths)
    ]
    n = len(samples)
    return pack_samples(samples, torch.randn(n), torch.rand(n), torch.rand(n), pad_token_id=0)


@pytest.mark.parametrize("loss", ["grpo", "gspo", "gspo_token"])
def test_reduces_exactly_to_the_uncorrected_loss_when_every_token_is_the_trained_versions(loss):
    """mu = pi_prox on every token (every token sampled by the trained version, no engine/trainer gap): every weight
    is 1, and each micro-batch's loss and gradient are bit-identical to algorithm.mismatch.correction=none's."""
    batch = _batch([3, 5, 2, 4])
    proximal = batch.rollout_log_probs.clone()
    minibatches = partition(batch, updates=2, micro_batch_size=2, dp_size=1, dp_rank=0)
    totals = step_totals(batch, 2)
    on = AlgorithmConfig(loss=LossConfig(name=loss), mismatch=MismatchConfig(correction="decoupled", cap=CAP))
    result = correct_mismatch(batch, proximal, minibatches, on, totals)
    assert result.totals is totals
    assert result.metrics["mismatch_is/weight_mean"] == 1.0
    for given, corrected in zip(
        (mb for m in minibatches for mb in m), (mb for m in result.minibatches for mb in m), strict=True
    ):
        mask = given.response_mask
        assert torch.equal(given.response_mask, corrected.response_mask)
        if corrected.advantages.dim() == 2:  # token weights: A_i x 1 on every valid token
            expanded = given.advantages.unsqueeze(-1).expand_as(mask)
            assert torch.equal(expanded[mask.bool()], corrected.advantages[mask.bool()])
        else:
            assert torch.equal(given.advantages, corrected.advantages)
        rows = batch.local(given.rows)
        old = proximal[rows][:, : mask.shape[1]]
        losses = []
        for advantages in (given.advantages, corrected.advantages):
            log_probs = (old + 0.01 * torch.arange(mask.numel()).reshape(mask.shape)).requires_grad_()
            out = get_policy_loss(loss)(log_probs, old, advantages, mask, LossContext(on.loss))
            out.loss.backward()
            losses.append((out.loss.detach(), log_probs.grad))
        assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])


def test_gspo_gets_row_weights_through_the_step():
    """correct_mismatch hands gspo one weight per row (the token weights' mean), grpo one per token."""
    batch = _batch([3, 5, 2, 4])
    proximal = batch.rollout_log_probs + 0.3 * torch.randn_like(batch.rollout_log_probs)
    minibatches = partition(batch, updates=1, micro_batch_size=4, dp_size=1, dp_rank=0)
    totals = step_totals(batch, 1)
    token, _ = mismatch_weights(proximal, batch.rollout_log_probs, batch.response_mask, "decoupled", cap=CAP)
    row_mean = token.sum(-1) / batch.response_mask.sum(-1)
    for loss, expected in (("gspo", batch.advantages * row_mean), ("grpo", batch.advantages.unsqueeze(-1) * token)):
        algorithm = AlgorithmConfig(
            loss=LossConfig(name=loss), mismatch=MismatchConfig(correction="decoupled", cap=CAP)
        )
        (mb,) = correct_mismatch(batch, proximal, minibatches, algorithm, totals).minibatches[0]
        expected = expected[mb.rows]
        torch.testing.assert_close(mb.advantages, expected if expected.dim() == 1 else expected[:, : mb.seq_len])


def test_config_composes_with_gspo_icepop_band_and_rejection_and_refuses_drop():
    AlgorithmConfig(mismatch=MismatchConfig(correction="decoupled"))  # gspo: row weights, no refusal
    MismatchConfig(correction="decoupled", lower=0.5, reject="sequence", veto=1e-4)
    AlgorithmConfig(loss=LossConfig(opsm_delta=1e-4), mismatch=MismatchConfig(correction="decoupled"))
    with pytest.raises(ValueError, match="rejected=drop with algorithm.mismatch.correction=decoupled"):
        MismatchConfig(correction="decoupled", rejected="drop")
