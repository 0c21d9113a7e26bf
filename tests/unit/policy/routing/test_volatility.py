"""Routing volatility, expert load, router entropy/KL on small hand-built tensors (numbers by hand)."""

import math

import pytest
import torch

from gspo_megatron.policy.routing.volatility import (
    RoutingVolatility,
    expert_load,
    routing_volatility,
    topk_overlap,
    topk_set_changed,
)

# 3 tokens, 2 layers, k = 2.
A = torch.tensor(
    [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
        [[0, 2], [1, 3]],
    ]
)
B = torch.tensor(
    [
        [[1, 0], [2, 4]],  # L0 same set permuted; L1 one of two shared
        [[6, 7], [7, 6]],  # L0 disjoint;          L1 same set permuted
        [[2, 0], [3, 5]],  # L0 same set permuted; L1 one of two shared
    ]
)


def test_changed_ignores_order_within_topk():
    expected = torch.tensor([[False, True], [True, False], [False, True]])
    assert torch.equal(topk_set_changed(A, B), expected)
    assert not topk_set_changed(A, A.flip(-1)).any()


def test_overlap_is_intersection_over_k():
    expected = torch.tensor([[1.0, 0.5], [0.0, 1.0], [1.0, 0.5]])
    assert torch.equal(topk_overlap(A, B), expected)


def test_volatility_per_layer_and_overall():
    v = routing_volatility(A, B)
    assert v.changed_frac.tolist() == pytest.approx([1 / 3, 2 / 3])
    assert v.overlap.tolist() == pytest.approx([2 / 3, 2 / 3])
    assert float(v.changed_frac_overall) == pytest.approx(3 / 6)
    assert float(v.overlap_overall) == pytest.approx(4 / 6)
    assert int(v.tokens) == 3
    # token-level: every token changed in some layer (t0 in L1, t1 in L0, t2 in L1), though per
    # layer only 1/3 and 2/3 did -- the per-layer figure understates what a token sees
    assert int(v.changed_any_count) == 3 and float(v.changed_any_frac) == 1.0


def test_volatility_both_ways_expert_sets_changed_and_experts_changed_per_slot():
    # k = 4, 2 tokens x 2 layers: one expert of four swapped in every (token, layer) pair
    a = torch.tensor([[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]])
    b = a.clone()
    b[..., 3] = 9
    v = routing_volatility(a, b)
    assert float(v.changed_frac_overall) == 1.0  # every set counts as changed
    assert float(v.experts_changed_per_slot) == 0.25  # but one slot in four changed
    # the worked example above: 8 of 12 slots shared
    assert float(routing_volatility(A, B).experts_changed_per_slot) == pytest.approx(4 / 12)
    assert float(routing_volatility(A, A.flip(-1)).experts_changed_per_slot) == 0.0


def test_changed_any_counts_a_token_once_however_many_layers_changed():
    a = torch.tensor([[[0, 1], [0, 1], [0, 1]], [[0, 1], [0, 1], [0, 1]], [[0, 1], [0, 1], [0, 1]]])
    b = a.clone()
    b[0, :, 0] = 5  # token 0 changed in all three layers
    b[1, 2, 1] = 7  # token 1 changed in the last layer only; token 2 unchanged
    v = routing_volatility(a, b)
    assert v.changed_count.tolist() == [1, 1, 2]
    assert int(v.changed_any_count) == 2 and float(v.changed_any_frac) == pytest.approx(2 / 3)
    unknown = RoutingVolatility(v.changed_count, v.intersection_count, v.tokens, v.top_k, torch.tensor(-1))
    assert math.isnan(float(unknown.changed_any_frac))


def test_volatility_respects_token_mask():
    v = routing_volatility(A, B, token_mask=torch.tensor([True, False, True]))
    assert v.changed_frac.tolist() == pytest.approx([0.0, 1.0])
    assert v.overlap.tolist() == pytest.approx([1.0, 0.5])
    assert float(v.changed_frac_overall) == pytest.approx(0.5)
    assert float(v.overlap_overall) == pytest.approx(0.75)
    assert int(v.tokens) == 2
    assert float(v.changed_any_frac) == pytest.approx(1.0)


def test_merge_of_two_halves_equals_whole():
    torch.manual_seed(1)
    probs = torch.rand(10, 3, 6)
    a = probs.topk(2, dim=-1).indices
    b = (probs + 0.3 * torch.rand(10, 3, 6)).topk(2, dim=-1).indices
    mask = torch.rand(10) > 0.3
    whole = routing_volatility(a, b, mask)
    halves = RoutingVolatility.merge_all(
        [routing_volatility(a[:4], b[:4], mask[:4]), routing_volatility(a[4:], b[4:], mask[4:])]
    )
    assert torch.equal(halves.changed_count, whole.changed_count)
    assert torch.equal(halves.intersection_count, whole.intersection_count)
    assert int(halves.changed_any_count) == int(whole.changed_any_count)
    assert int(halves.tokens) == int(whole.tokens) == int(mask.sum())
    # and not the mean of the halves' fractions (the halves have different token counts)
    assert 0 < float(whole.changed_frac_overall) < 1


def test_volatility_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="same tokens"):
        routing_volatility(A, B[:2])
    with pytest.raises(ValueError, match="integer"):
        routing_volatility(A.float(), B.float())
    with pytest.raises(ValueError, match="token_mask"):
        routing_volatility(A, B, token_mask=torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="different shapes"):
        routing_volatility(A, B).merge(routing_volatility(A[:, :1], B[:, :1]))


def test_expert_load_fractions_and_imbalance():
    load = expert_load(A, num_experts=8)
    # layer 0 picks 0,1 | 4,5 | 0,2 ; layer 1 picks 2,3 | 6,7 | 1,3
    assert load.counts.tolist() == [[2, 1, 1, 0, 1, 1, 0, 0], [0, 1, 1, 2, 0, 0, 1, 1]]
    assert load.fraction[0].tolist() == pytest.approx([2 / 6, 1 / 6, 1 / 6, 0, 1 / 6, 1 / 6, 0, 0])
    assert load.fraction.sum(-1).tolist() == pytest.approx([1.0, 1.0])
    # mean count 6/8 = 0.75, max 2 -> 8/3; population variance (1.25^2 + 4*0.25^2 + 3*0.75^2)/8 = 0.4375
    assert load.imbalance.tolist() == pytest.approx([8 / 3, 8 / 3])
    assert load.coefficient_of_variation.tolist() == pytest.approx([math.sqrt(0.4375) / 0.75] * 2)


def test_expert_load_mask_merge_and_range_check():
    mask = torch.tensor([True, False, True])
    load = expert_load(A, 8, token_mask=mask)
    assert load.counts[0].tolist() == [2, 1, 1, 0, 0, 0, 0, 0]
    assert int(load.tokens) == 2
    merged = expert_load(A[:1], 8).merge(expert_load(A[1:], 8))
    assert torch.equal(merged.counts, expert_load(A, 8).counts)
    with pytest.raises(ValueError, match="num_experts"):
        expert_load(A, num_experts=7)
