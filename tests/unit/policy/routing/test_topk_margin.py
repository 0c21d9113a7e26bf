"""The router's top-k margin (``policy/routing/topk_margin.py``) on hand-built router outputs: the k-th minus the
(k+1)-th score per token, its histogram per layer over the real tokens, and the recording that keeps it
(megatron's real ``RouterReplay``, as the recorder's tests use it)."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.policy.routing.recorder import RoutingRecorder
from gspo_megatron.policy.routing.replay import RoutingReplay
from gspo_megatron.policy.routing.topk_margin import MARGIN_EDGES, TopkMargins, topk_margin, topk_margins

# 3 tokens, 5 experts: token 0 ranks 4.0 > 3.5 > 1.0 > 0.9 > 0; token 1 has a tie at its 2nd/3rd; token 2 is unsorted
LOGITS = torch.tensor(
    [
        [0.0, 3.5, 1.0, 4.0, 0.9],
        [2.0, 2.0, 5.0, -1.0, 0.0],
        [0.2, -0.3, 0.25, 0.0, 1.0],
    ]
)


def test_margin_is_the_kth_minus_the_next_score():
    assert topk_margin(LOGITS, 2).tolist() == pytest.approx([3.5 - 1.0, 0.0, 0.25 - 0.2])
    assert topk_margin(LOGITS, 1).tolist() == pytest.approx([0.5, 3.0, 0.75])


def test_margin_refuses_a_k_with_no_next_expert():
    with pytest.raises(ValueError, match="1 <= k < experts"):
        topk_margin(LOGITS, 5)


def test_histogram_counts_masked_tokens_per_layer_by_edges():
    layer0 = torch.tensor([2.5, 0.0, 0.05])  # bins [1, 3), [0, 1e-3), [0.03, 0.1)
    layer1 = torch.tensor([0.002, 5.0, 0.5])  # [1e-3, 3e-3), [3, inf), [0.3, 1) -- the last token is masked out
    margins = topk_margins([layer0, layer1], torch.tensor([True, True, False]))
    expected = torch.zeros(2, len(MARGIN_EDGES), dtype=torch.long)
    expected[0, MARGIN_EDGES.index(1.0)] = 1
    expected[0, 0] = 1
    expected[1, MARGIN_EDGES.index(1e-3)] = 1
    expected[1, MARGIN_EDGES.index(3.0)] = 1
    assert torch.equal(margins.counts, expected)
    assert margins.mean.tolist() == pytest.approx([2.5 / 2, 5.002 / 2])
    assert margins.fraction_below(1e-3) == pytest.approx(1 / 4)
    assert margins.fraction_below(0.1) == pytest.approx(2 / 4)
    assert margins.metrics()["routing/topk_margin_below_3"] == pytest.approx(3 / 4)


def test_histograms_merge_exactly_by_addition():
    mask = torch.tensor([True, True, True])
    a = topk_margins([topk_margin(LOGITS, 2)], mask)
    b = topk_margins([topk_margin(LOGITS.flip(-1), 3)], mask)
    both = a.merge(b)
    assert torch.equal(both.counts, a.counts + b.counts)
    assert int(both.tokens[0]) == 6
    with pytest.raises(ValueError, match="cannot merge"):
        a.merge(TopkMargins.concat_layers([a, b]))


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, topk, dim=-1)


def test_a_recording_keeps_each_layers_margins_per_forward_and_a_replay_none(instances):
    recorder = RoutingRecorder(RoutingReplay(instances))
    with recorder.record() as recording:
        for scale in (1.0, 2.0):  # two forwards (micro-batches); layer 1 sees the logits reversed
            for inst, logits in zip(instances, (LOGITS * scale, LOGITS.flip(-1) * scale), strict=True):
                inst.get_replay_topk(logits, 2, default_compute_topk=_topk)
    assert len(recording.margins) == 2 and all(len(mb) == 2 for mb in recording.margins)
    assert recording.margins[1][0].tolist() == pytest.approx([5.0, 0.0, 0.1])  # twice the first forward's
    assert recording.margins[0][1].tolist() == pytest.approx(topk_margin(LOGITS.flip(-1), 2).tolist())
    targets = [[torch.tensor([[0, 1], [0, 1], [0, 1]])] * 2]
    with recorder.replay(targets, observe=True) as replayed:
        replayed.before_forward()
        for inst in instances:
            inst.get_replay_topk(LOGITS, 2, default_compute_topk=_topk)
    assert replayed.margins == []
