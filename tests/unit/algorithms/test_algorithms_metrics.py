"""Additive metric dicts: merge by suffix, finalize sums/counts once, empty selections stay honest."""

import math

import pytest
import torch

from gspo_megatron.algorithms import finalize_metrics, merge_metrics, token_mean_metric
from gspo_megatron.algorithms.metrics import extremum_entries, mean_entries


def test_merge_then_finalize_is_the_pooled_mean_not_the_mean_of_means():
    a = {
        **mean_entries("x", torch.tensor(3.0), torch.tensor(1.0)),
        **extremum_entries("x", torch.tensor([3.0]), torch.tensor([True])),
    }
    b = {
        **mean_entries("x", torch.tensor(3.0), torch.tensor(3.0)),
        **extremum_entries("x", torch.tensor([0.0, 2.0, 1.0]), torch.tensor([True] * 3)),
    }
    out = finalize_metrics(merge_metrics(merge_metrics(None, a), b))
    assert out["x"].item() == pytest.approx(6 / 4)  # mean of means would be 2.0
    assert out["x/min"].item() == 0.0 and out["x/max"].item() == 3.0


def test_empty_selection_merges_as_identity_and_finalizes_to_nan():
    empty = {
        **mean_entries("x", torch.tensor(0.0), torch.tensor(0.0)),
        **extremum_entries("x", torch.tensor([5.0]), torch.tensor([False])),
    }
    out = finalize_metrics(empty)
    assert math.isnan(out["x"].item()) and math.isnan(out["x/min"].item())
    full = {
        **mean_entries("x", torch.tensor(4.0), torch.tensor(2.0)),
        **extremum_entries("x", torch.tensor([1.0]), torch.tensor([True])),
    }
    merged = finalize_metrics(merge_metrics(empty, full))
    assert merged["x"].item() == 2.0 and merged["x/max"].item() == 1.0


def test_token_mean_metric_uses_only_valid_tokens():
    entropy = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = finalize_metrics(token_mean_metric("entropy", entropy, mask))
    assert out["entropy"].item() == pytest.approx(15 / 5)


def test_bad_keys_are_rejected():
    with pytest.raises(ValueError, match="no reduction suffix"):
        merge_metrics({"x": torch.tensor(1.0)}, {"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="different keys"):
        merge_metrics({"x/sum": torch.tensor(1.0)}, {"y/sum": torch.tensor(1.0)})
