import math

import pytest
import torch

from gspo_megatron.algorithms.mismatch_metric import finalize_mismatch, train_inference_mismatch


def test_sums_and_counts_by_hand():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, float("-inf")]])
    rollout = torch.tensor([[-1.5, -2.0, -1.5], [-2.0, -0.9, -0.2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # |delta| on valid tokens: 0.5, 0, 1.0, 1.0, 0.8 -> sum 3.3; > ln2 (0.693): 1.0, 1.0, 0.8 -> 3
    out = train_inference_mismatch(train, rollout, mask)
    assert out["abs_log_prob_diff_sum"].item() == pytest.approx(3.3)
    assert out["large_diff_count"].item() == 3
    assert out["token_count"].item() == 5
    final = finalize_mismatch(out)
    assert final["mismatch/abs_log_prob_diff_mean"].item() == pytest.approx(3.3 / 5)
    assert final["mismatch/large_diff_fraction"].item() == pytest.approx(3 / 5)


def test_threshold_is_strictly_above_ln2():
    train = torch.tensor([0.0, 0.0], dtype=torch.float64)
    rollout = torch.tensor([-math.log(2.0), -math.log(2.0) - 1e-3], dtype=torch.float64)
    out = train_inference_mismatch(train, rollout, torch.ones(2))
    assert out["large_diff_count"].item() == 1


def test_sums_add_across_micro_batches():
    a = train_inference_mismatch(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([1]))
    b = train_inference_mismatch(torch.tensor([-1.0, -1.0]), torch.tensor([-1.2, -1.0]), torch.tensor([1, 1]))
    total = {k: a[k] + b[k] for k in a}
    assert finalize_mismatch(total)["mismatch/abs_log_prob_diff_mean"].item() == pytest.approx(1.2 / 3)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shapes differ"):
        train_inference_mismatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2))
