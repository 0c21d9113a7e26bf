"""Rejection sampling, the veto and IcePop against the anchors' formulas, transcribed here from their source:

- slime (THUDM/slime 624b824): ``examples/train_infer_mismatch_helper/mis.py`` -- ``compute_mis_weights`` with
  ``mis_mode=mask`` (levels token / sequence / geometric, [lower, upper] on the safety-bounded ratio) and
  ``calculate_veto_mask``; ``slime/backends/megatron_utils/loss.py:icepop_function`` (``--tis-clip`` /
  ``--tis-clip-low``). slime's ``compute_mis_weights`` returns early with a float when ``mis_lower_bound`` is
  None (``return 1.0 / args.mis_upper_bound``): its lower bound is transcribed as given, which is how verl's
  default (1 / upper) is passed too.
- verl (``docs/algo/rollout_corr.md``): ``rollout_rs`` token / sequence / geometric, lower defaulting to
  1 / upper, the token veto on the unbounded ratio; presets ``seq_mis`` and ``geo_rs`` (thresholds below).

Inputs: random log-probs with extreme ratios (|log rho| up to 30, past the safety bound) and ragged masks.
"""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms.mismatch_correction import mismatch_weights
from gspo_megatron.algorithms.mismatch_rejection import finalize_rejection_stats, rejection_keep_mask


def _slime_masked_sum(x, loss_mask):
    return (x * loss_mask).sum()


def _slime_masked_mean(x, loss_mask):
    return _slime_masked_sum(x, loss_mask) / torch.clamp_min(loss_mask.sum(), 1)


def slime_mis_mask(train, rollout, loss_mask, level, lower, upper, veto):
    """slime's ``compute_mis_weights`` (mask mode) for one sequence: its ``modified_mask``."""
    loss_mask = loss_mask.float()
    raw = train - rollout
    if level == "token":
        log_ratio = raw
    elif level == "sequence":
        log_ratio = _slime_masked_sum(raw, loss_mask).expand_as(raw)
    else:
        log_ratio = _slime_masked_mean(raw, loss_mask).expand_as(raw)
    weights = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    in_range = (weights >= lower) & (weights <= upper)
    modified = loss_mask * in_range.float()
    if veto is not None:
        catastrophic = (raw < torch.log(torch.tensor(veto, dtype=raw.dtype))) & loss_mask.bool()
        modified = modified * (~catastrophic.any()).float().expand_as(raw)
    return modified


def slime_icepop_weight(old, rollout, tis_clip_low, tis_clip):
    """slime's ``icepop_function``: ice_weight."""
    ratio = torch.exp(old - rollout)
    return torch.where((ratio >= tis_clip_low) & (ratio <= tis_clip), ratio, torch.zeros_like(ratio))


def _random_batch(seed: int, rows: int = 64, width: int = 12):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 5
    scale = torch.tensor([0.001, 0.05, 0.5, 30.0], dtype=torch.float64)[torch.randint(0, 4, (rows, 1), generator=g)]
    old = rollout + torch.randn(rows, width, generator=g, dtype=torch.float64) * scale
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width) < lengths.unsqueeze(1)).float()
    mask[0] = 0  # one row without a valid token
    return old, rollout, mask


# (level, upper, lower as passed to slime, veto): verl's seq_mis (upper 2, lower 1/2 by default), its
# geo_rs (1.001 / 0.999, veto 1e-4), a token band, and a veto alone over the sequence level
CASES = [
    ("sequence", 2.0, None, None),
    ("geometric", 1.001, 0.999, 1e-4),
    ("token", 2.0, 0.5, None),
    ("sequence", 5.0, 0.0, 1e-4),
]


@pytest.mark.parametrize("level, upper, lower, veto", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_equals_slimes_mask_mode_row_by_row(level, upper, lower, veto, seed):
    old, rollout, mask = _random_batch(seed)
    keep, _ = rejection_keep_mask(old, rollout, mask, level, upper, lower, veto)
    slime_lower = 1.0 / upper if lower is None else lower  # verl's default, passed explicitly
    for i in range(old.shape[0]):
        expected = slime_mis_mask(old[i], rollout[i], mask[i], level, slime_lower, upper, veto)
        assert torch.equal(keep[i].double(), expected), (level, i)


def test_the_bands_reject_on_both_sides_and_the_metrics_count_them():
    """Two rows of 2 tokens: rho (2, 2) and (1/4, 1); sequence level, band [1/2, 2] (verl's default lower):
    row 0's product 4 is above, row 1's 1/4 below. Geometric means 2 and 1/2 fit [0.4, 2.5]; the veto 1/3 then
    rejects row 1 by its first token."""
    rollout = torch.zeros(2, 2)
    old = torch.log(torch.tensor([[2.0, 2.0], [0.25, 1.0]]))
    mask = torch.ones(2, 2)
    keep, stats = rejection_keep_mask(old, rollout, mask, "sequence", 2.0)
    assert not keep.any()
    metrics = finalize_rejection_stats(stats)
    assert metrics == {
        "mismatch_rs/above_frac": 0.5,
        "mismatch_rs/below_frac": 0.5,
        "mismatch_rs/rejected_token_frac": 1.0,
    }
    keep, stats = rejection_keep_mask(old, rollout, mask, "geometric", 2.5, veto=1 / 3)  # 2 and 1/2: in [0.4, 2.5]
    assert keep.tolist() == [[True, True], [False, False]]
    metrics = finalize_rejection_stats(stats)
    assert metrics["mismatch_rs/veto_row_frac"] == 0.5 and metrics["mismatch_rs/veto_token_frac"] == 0.25


@pytest.mark.parametrize("low, high", [(0.0, 2.0), (0.5, 5.0)])  # slime's defaults; the IcePop paper's band
def test_token_mask_with_a_lower_bound_equals_slimes_icepop(low, high):
    old, rollout, mask = _random_batch(3)
    weights, metrics = mismatch_weights(old, rollout, mask, "token_mask", cap=high, lower=low)
    expected = slime_icepop_weight(old, rollout, low, high) * mask
    # ours bounds log rho at +-20 before exp (a ratio below e^-20 is kept as e^-20 when low = 0)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=2 * math.exp(-20))
    masked = ((expected == 0) & (mask > 0)).sum() / mask.sum()
    assert metrics["mismatch_is/masked_frac"].item() == pytest.approx(masked.item())
