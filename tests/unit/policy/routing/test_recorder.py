"""RoutingRecorder on megatron's real ``RouterReplay`` instances: each context records or replays and
always leaves the routers reset, also when the forward inside it raised."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.policy.routing.recorder import RoutingRecorder
from gspo_megatron.policy.routing.replay import ReplayError, RoutingReplay

K = 2


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, topk, dim=-1)


def _forward(instances, scores, before=None):
    if before is not None:
        before()
    return [
        inst.get_replay_topk(s, K, default_compute_topk=_topk)[1] for inst, s in zip(instances, scores, strict=True)
    ]


SCORES = [torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])] * 2  # 2 tokens, 4 experts, 2 layers
TARGETS = [torch.tensor([[0, 1], [2, 3]])] * 2


def test_record_returns_each_forward_in_order(instances):
    recorder = RoutingRecorder(RoutingReplay(instances))
    with recorder.record() as recording:
        first = _forward(instances, SCORES)
        second = _forward(instances, [s.flip(-1) for s in SCORES])
    assert [[t.tolist() for t in mb] for mb in recording.routing] == [
        [t.tolist() for t in first],
        [t.tolist() for t in second],
    ]
    assert first[0].tolist() == [[3, 2], [0, 1]]
    assert all(inst.router_replay_action is None for inst in instances)


def test_replay_routes_with_the_targets_and_observes_them(instances):
    recorder = RoutingRecorder(RoutingReplay(instances))
    with recorder.replay([TARGETS], observe=True) as recording:
        routed = _forward(instances, SCORES, recording.before_forward)
    assert [t.tolist() for t in routed] == [t.tolist() for t in TARGETS]
    assert [t.tolist() for t in recording.routing[0]] == [t.tolist() for t in TARGETS]
    assert all(inst.router_replay_action is None for inst in instances)


def test_unconsumed_targets_fail_and_a_failed_forward_leaves_no_replay_armed(instances):
    recorder = RoutingRecorder(RoutingReplay(instances))
    with (
        pytest.raises(ReplayError, match="2 replay targets queued but 1 forwards consumed them"),
        recorder.replay([TARGETS, TARGETS]) as recording,
    ):
        _forward(instances, SCORES, recording.before_forward)
    with pytest.raises(RuntimeError, match="forward failed"), recorder.replay([TARGETS]):
        raise RuntimeError("forward failed")
    assert all(inst.router_replay_action is None for inst in instances)
    free = _forward(instances, SCORES)  # the next forward routes freely
    assert free[0].tolist() == [[3, 2], [0, 1]]


def test_without_routers_every_recording_is_empty():
    recorder = RoutingRecorder(None)
    assert not recorder.has_routers
    for context in (recorder.record(), recorder.replay([TARGETS]), recorder.route_freely()):
        with context as recording:
            assert recording.before_forward is None
        assert recording.routing == []
