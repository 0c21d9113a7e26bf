"""The ratio decomposition on a 2-expert, top-1 toy MoE whose router is forced to flip one token.

The toy scores a 2-word vocabulary: logits = g_e * (W_e x) with e the routed expert and g_e its gate
(softmax of the router scores). A new router sends token 0 -- and only token 0 -- to the other
expert; the experts' weights move too. Then the routing part of token 0 must equal what the flip
alone does to its log-prob (current weights, old vs flipped expert), every other token's routing part
must be 0, and routing + weight part must be log w.
"""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.policy.routing.ratio_decomposition import (
    RatioDecomposition,
    changed_in_any_layer,
    decompose_log_ratio,
)

F64 = torch.float64
X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, -1.0]], dtype=F64)  # 3 tokens of one response
TARGETS = torch.tensor([0, 1, 0])
ROUTER_OLD = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=F64)  # experts of tokens 0, 1, 2: 0, 1, 0
ROUTER_NEW = torch.tensor([[0.0, -2.0], [1.0, 0.0]], dtype=F64)  # token 0 -> expert 1; tokens 1, 2 keep theirs
EXPERTS_OLD = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.5, 0.5], [-1.0, 1.0]]], dtype=F64)
EXPERTS_NEW = EXPERTS_OLD + torch.tensor([[[0.1, 0.0], [0.0, -0.2]], [[0.0, 0.3], [0.1, 0.0]]], dtype=F64)


def toy_log_probs(router, experts, forced: torch.Tensor | None = None):
    """(log-prob of each target [3], routed expert per token [3]); ``forced`` replays experts."""
    gates = torch.softmax(X @ router.T, dim=-1)  # [3, 2]
    chosen = gates.argmax(dim=-1) if forced is None else forced
    logits = torch.stack([gates[n, chosen[n]] * (experts[chosen[n]] @ X[n]) for n in range(3)])
    return torch.log_softmax(logits, dim=-1)[torch.arange(3), TARGETS], chosen


def test_a_forced_flip_is_the_routing_part_and_the_parts_sum_to_log_w():
    old_lp, old_experts = toy_log_probs(ROUTER_OLD, EXPERTS_OLD)
    train_lp, new_experts = toy_log_probs(ROUTER_NEW, EXPERTS_NEW)
    replayed_lp, _ = toy_log_probs(ROUTER_NEW, EXPERTS_NEW, forced=old_experts)
    assert old_experts.tolist() == [0, 1, 0] and new_experts.tolist() == [1, 1, 0]  # the one forced flip

    # the flip alone, by hand: current weights, token 0 on expert 0 vs 1 (router scores 0 and 1)
    gate_old_expert, gate_new_expert = 1 / (1 + math.e), 1 / (1 + math.exp(-1))
    logits_before = gate_old_expert * (EXPERTS_NEW[0] @ X[0])
    logits_after = gate_new_expert * (EXPERTS_NEW[1] @ X[0])
    flip_alone = float(torch.log_softmax(logits_after, -1)[0] - torch.log_softmax(logits_before, -1)[0])

    mask = torch.ones(1, 3)
    changed = changed_in_any_layer(old_experts.view(3, 1, 1), new_experts.view(3, 1, 1)).view(1, 3)
    assert changed.tolist() == [[True, False, False]]
    routing = train_lp - replayed_lp
    weight = replayed_lp - old_lp
    assert float(routing[0]) == pytest.approx(flip_alone, abs=1e-12) and abs(flip_alone) > 0.05
    assert routing[1:].abs().max() == 0  # unchanged tokens: same expert, same gate, same weights
    assert torch.allclose(routing + weight, train_lp - old_lp, atol=1e-15, rtol=0)

    advantages = torch.tensor([1.0], dtype=F64)
    sums = decompose_log_ratio(
        train_lp.view(1, 3), replayed_lp.view(1, 3), old_lp.view(1, 3), mask, changed, advantages, 0.2, 0.2
    )
    m = sums.metrics()
    log_w = (train_lp - old_lp).tolist()
    assert m["ratio_decomp/token_changed_frac"] == pytest.approx(1 / 3)
    assert m["ratio_decomp/token_changed_abs_routing"] == pytest.approx(abs(flip_alone), abs=1e-12)
    assert m["ratio_decomp/token_changed_abs_log_ratio"] == pytest.approx(abs(log_w[0]), abs=1e-12)
    assert m["ratio_decomp/token_unchanged_abs_routing"] == 0
    assert m["ratio_decomp/token_unchanged_abs_log_ratio"] == pytest.approx((abs(log_w[1]) + abs(log_w[2])) / 2)
    expected_clip = [float(w > math.log(1.2)) for w in log_w]  # A > 0: the high side only
    assert m["ratio_decomp/token_changed_clip_frac"] == expected_clip[0]
    assert m["ratio_decomp/token_unchanged_clip_frac"] == pytest.approx(sum(expected_clip[1:]) / 2)
    shares = [m[f"ratio_decomp/token_var_share_{p}"] for p in ("routing", "weight", "cross")]
    assert sum(shares) == pytest.approx(1.0, abs=1e-12)
    var_r = torch.var(routing, unbiased=False)
    assert shares[0] == pytest.approx(float(var_r / torch.var(train_lp - old_lp, unbiased=False)), rel=1e-12)
    # sequence level: one response, changed (token 0 is), log s = mean r + mean v
    assert m["ratio_decomp/seq_changed_frac"] == 1.0
    assert m["ratio_decomp/seq_changed_abs_log_ratio"] == pytest.approx(abs(sum(log_w) / 3), abs=1e-12)
    assert m["ratio_decomp/seq_changed_abs_routing"] == pytest.approx(abs(flip_alone) / 3, abs=1e-12)
    assert math.isnan(m["ratio_decomp/seq_unchanged_abs_log_ratio"])  # no unchanged sequence: NaN, not 0


def test_replayed_routing_has_no_routing_part_and_merging_equals_one_batch():
    """Under R2 the loss's forward replays the old routing: r == 0, all of log w is the weight part."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 6, generator=g, dtype=F64)
    replayed = old + 0.1 * torch.randn(4, 6, generator=g, dtype=F64)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    mask[0] = 0  # a row with no response token counts nowhere
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=F64)
    none_changed = torch.zeros(4, 6, dtype=torch.bool)
    whole = decompose_log_ratio(replayed, replayed, old, mask, none_changed, advantages, 0.2, 0.28)
    m = whole.metrics()
    assert m["ratio_decomp/token_var_share_routing"] == 0 and m["ratio_decomp/token_var_share_weight"] == 1
    assert m["ratio_decomp/token_unchanged_frac"] == 1 and m["ratio_decomp/seq_unchanged_frac"] == 1
    assert float(whole["token/count"]) == float(mask.sum()) and float(whole["seq/count"]) == 3
    halves = [
        decompose_log_ratio(replayed[s], replayed[s], old[s], mask[s], none_changed[s], advantages[s], 0.2, 0.28)
        for s in (slice(0, 2), slice(2, 4))
    ]
    merged = RatioDecomposition.zeros().merge(halves[0]).merge(halves[1])
    assert torch.allclose(merged.sums, whole.sums, rtol=1e-12, atol=1e-12)


def test_mismatched_shapes_are_refused():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        decompose_log_ratio(x, x, torch.zeros(2, 4), x, x.bool(), torch.zeros(2), 0.2, 0.2)
