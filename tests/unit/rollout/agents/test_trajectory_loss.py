"""A trajectory's inserted tokens carry no loss, no gradient, no KL or entropy term, and GSPO's length
normalisation counts the generated tokens only -- by hand, on a trajectory built with known masks."""

from __future__ import annotations

import math

import torch

from gspo_megatron.algorithms.losses import LossConfig, LossContext, get_policy_loss
from gspo_megatron.algorithms.regularizers import entropy_bonus
from gspo_megatron.contracts.samples import FinishReason, Sample, TurnSpan
from gspo_megatron.rollout.pack import pack_samples

PROMPT = [5, 6, 7]
# turn 1 generates 2 tokens, a tool's answer inserts 3, turn 2 generates 3
OUTPUT = [10, 11, 40, 41, 42, 12, 13, 14]
INSERTED = torch.tensor([False, False, True, True, True, False, False, False])


def trajectory() -> Sample:
    log_probs = torch.tensor([-0.5, -0.7, 0.0, 0.0, 0.0, -0.2, -0.9, -0.4])
    return Sample(
        PROMPT,
        OUTPUT,
        log_probs,
        FinishReason.STOP,
        inserted_mask=INSERTED,
        turns=[TurnSpan(0, 2, 1), TurnSpan(5, 8, 1)],
    )


def test_the_loss_and_its_gradient_are_the_generated_tokens_gspo_by_hand():
    batch = pack_samples([trajectory()], torch.tensor([1.5]), torch.ones(1), torch.ones(1), pad_token_id=0)
    mask = batch.response_mask  # [1, S-1]
    p = len(PROMPT)
    generated = (~INSERTED).float()
    assert torch.equal(mask[0, p - 1 : p - 1 + len(OUTPUT)], generated)
    old = batch.rollout_log_probs.clone()
    new = (old + 0.02 * torch.arange(old.shape[1], dtype=torch.float32)).requires_grad_(True)
    config = LossConfig(name="gspo", clip_low=0.2, clip_high=0.3)
    out = get_policy_loss("gspo")(new, old, batch.advantages, mask, LossContext(config))
    out.loss.backward()
    # by hand: s = exp(mean of log-ratios over the 5 generated targets); A = 1.5 > 0, unclipped below 1.3
    positions = [p - 1 + i for i in range(len(OUTPUT)) if not INSERTED[i]]
    log_s = sum(0.02 * j for j in positions) / len(positions)
    s = math.exp(log_s)
    assert s < 1.3
    assert math.isclose(float(out.loss), -s * 1.5, rel_tol=1e-5)
    expected = torch.zeros_like(new)
    for j in positions:  # d(-s A)/d new_j = -A s / |y|, at generated targets only
        expected[0, j] = -1.5 * s / len(positions)
    torch.testing.assert_close(new.grad, expected, atol=1e-6, rtol=1e-5)


def test_the_entropy_term_counts_the_generated_tokens_only():
    batch = pack_samples([trajectory()], torch.tensor([1.0]), torch.ones(1), torch.ones(1), pad_token_id=0)
    entropy = torch.rand(batch.response_mask.shape).requires_grad_(True)
    config = LossConfig(name="gspo", clip_low=0.2, clip_high=0.3)
    term = entropy_bonus(entropy, batch.response_mask, LossContext(config), 0.1)
    term.backward()
    assert torch.equal(entropy.grad != 0, batch.response_mask.bool())  # inserted and padding: no gradient
