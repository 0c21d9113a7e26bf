"""Token- vs sequence-ratio dispersion by response length, on hand-computed values."""

import math

import pytest
import torch

from gspo_megatron.algorithms.metrics import finalize_metrics
from gspo_megatron.algorithms.ratio_dispersion import ratio_dispersion_metrics


def _sum(x):
    return x.sum(-1)


def test_hand_values_per_bucket_and_gap():
    # row 0: one token, log w = ln 2 (w = 2, s = 2); row 1: two tokens, log w = +-ln 2 (w = 2, 1/2; s = 1);
    # row 2: 6 tokens of w = 1 (bucket 5..16); row 3: no valid token (ignored)
    log2 = math.log(2.0)
    log_ratio = torch.zeros(4, 6)
    log_ratio[0, 0] = log2
    log_ratio[1, :2] = torch.tensor([log2, -log2])
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[0, 0] = True
    mask[1, :2] = True
    mask[2, :] = True
    lengths = mask.float().sum(-1)
    out = {k: float(v) for k, v in finalize_metrics(ratio_dispersion_metrics(log_ratio, mask, lengths, _sum)).items()}
    # bucket 1..4: tokens w = 2, 2, 1/2 -> (1 + 1 + 1/4) / 3; sequences s = 2, 1 -> (1 + 0) / 2
    assert out["ratio_var_token/len_1_4"] == pytest.approx(2.25 / 3)
    assert out["ratio_var_seq/len_1_4"] == pytest.approx(0.5)
    assert out["ratio_var_token/len_5_16"] == 0.0 and out["ratio_var_seq/len_5_16"] == 0.0
    assert math.isnan(out["ratio_var_token/len_17_64"]) and math.isnan(out["ratio_var_seq/len_65_up"])
    # gap: row 0 |2 - 2| = 0; row 1 |2 - 1| + |0.5 - 1| = 1.5; row 2: 0 -> 1.5 / 9 tokens
    assert out["ratio_token_seq_gap"] == pytest.approx(1.5 / 9)


def test_one_token_answers_have_no_gap():
    log_ratio = torch.tensor([[0.3], [-0.2]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    out = finalize_metrics(ratio_dispersion_metrics(log_ratio, mask, mask.float().sum(-1), _sum))
    assert float(out["ratio_token_seq_gap"]) == 0.0
    assert float(out["ratio_var_token/len_1_4"]) == pytest.approx(float(out["ratio_var_seq/len_1_4"]))
