"""Off-policy sequence masking against slime's ``compute_opsm_mask`` (THUDM/slime 624b824,
``slime/utils/ppo_utils.py``), transcribed below, on random inputs with large drifts; and the masked tokens'
loss and gradient are exactly those of ``pg_loss * opsm_mask``."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms.losses import LossConfig, LossContext, get_policy_loss
from gspo_megatron.algorithms.off_policy_masking import off_policy_sequence_mask


def slime_opsm_mask(full_log_probs, full_old_log_probs, advantages, loss_masks, opsm_delta):
    """slime's compute_opsm_mask over per-sample 1-D tensors: the concatenated per-token mask."""
    out = []
    for full_log_prob, full_old_log_prob, advantage, loss_mask in zip(
        full_log_probs, full_old_log_probs, advantages, loss_masks, strict=False
    ):
        seq_kl = ((full_old_log_prob - full_log_prob) * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)
        mask = ((advantage < 0) & (seq_kl > opsm_delta)).float()
        out.append(1 - mask)
    return out


def _inputs(seed: int, rows: int = 48, width: int = 10):
    g = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(rows, width, generator=g) * 4
    drift = (
        torch.randn(rows, 1, generator=g) * torch.tensor([1e-5, 1e-3, 1.0])[torch.randint(0, 3, (rows, 1), generator=g)]
    )
    old = log_probs + drift + 1e-4 * torch.randn(rows, width, generator=g)
    advantages = torch.randn(rows, generator=g)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width) < lengths.unsqueeze(1)).float()
    return log_probs, old, advantages, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("per_token", [False, True])
def test_masked_advantages_are_zero_exactly_where_slimes_mask_is(seed, per_token):
    log_probs, old, advantages, mask = _inputs(seed)
    adv = advantages.unsqueeze(-1).expand_as(mask).clone() if per_token else advantages
    masked, stats = off_policy_sequence_mask(log_probs, old, adv, mask, 1e-4)
    slime = slime_opsm_mask(
        [lp[m > 0] for lp, m in zip(log_probs, mask, strict=True)],
        [o[m > 0] for o, m in zip(old, mask, strict=True)],
        [a.expand(int(m.sum())) for a, m in zip(advantages, mask, strict=True)],
        [m[m > 0] for m in mask],
        1e-4,
    )
    for i, keep in enumerate(slime):
        zeroed = (masked[i] == 0) if not per_token else (masked[i][mask[i] > 0] == 0)
        assert torch.equal(zeroed.expand_as(keep), keep == 0), i
    dropped = sum(float((k == 0).all()) for k in slime)
    assert 0 < dropped < len(slime)
    assert (stats["loss/opsm_masked_frac/sum"].item(), stats["loss/opsm_masked_frac/count"].item()) == (
        dropped,
        len(slime),
    )


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_the_loss_and_gradient_equal_slimes_pg_loss_times_the_mask(loss):
    """token_mean GRPO and GSPO: the loss of the masked advantages equals the loss with the masked sequences'
    tokens contributing 0 (slime multiplies pg_loss by the mask, the denominators unchanged): computed here by
    zeroing those sequences' advantages by hand from slime's mask."""
    log_probs, old, advantages, mask = _inputs(4)
    slime = slime_opsm_mask(list(log_probs), list(old), list(advantages), list(mask), 1e-4)
    keep_rows = torch.tensor([bool(k.all()) for k in slime])
    settings = LossConfig(name=loss, clip_low=0.2, clip_high=0.28, opsm_delta=1e-4)
    ctx = LossContext(settings, global_num_sequences=torch.tensor(48.0), global_num_tokens=mask.sum())
    fn = get_policy_loss(loss)
    ours_lp = log_probs.clone().requires_grad_(True)
    masked, _ = off_policy_sequence_mask(ours_lp, old, advantages, mask, 1e-4)
    ours = fn(ours_lp, old, masked, mask, ctx).loss
    ours.backward()
    hand_lp = log_probs.clone().requires_grad_(True)
    hand = fn(hand_lp, old, torch.where(keep_rows, advantages, 0.0), mask, ctx).loss
    hand.backward()
    assert ours.item() == hand.item() and torch.equal(ours_lp.grad, hand_lp.grad)
    assert ours_lp.grad[~keep_rows].abs().sum() == 0 and ours_lp.grad[keep_rows].abs().sum() > 0
