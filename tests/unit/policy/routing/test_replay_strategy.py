"""The replay strategies on megatron's real ``RouterReplay`` instances: each forward below calls
``get_replay_topk`` exactly as megatron's router does (with its top-k as ``default_compute_topk``)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from gspo_megatron.policy.routing.recorder import RoutingRecorder
from gspo_megatron.policy.routing.replay import RoutingReplay
from gspo_megatron.policy.routing.replay_strategy import (
    build_replay_strategy,
    needs_engine_routing,
    needs_trainer_old_pass,
    replays,
)

K = 2
OldPassRouting = namedtuple("OldPassRouting", "old_policy_routing trainer_routing")


@pytest.fixture
def instances():
    before = len(RouterReplay.global_router_replay_instances)
    made = [RouterReplay() for _ in range(2)]  # two MoE layers
    yield made
    del RouterReplay.global_router_replay_instances[before:]


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, topk, dim=-1)


def _forward(instances, scores, before=None) -> list[torch.Tensor]:
    """One model forward: each MoE layer's router picks its top-k through RouterReplay."""
    if before is not None:
        before()
    return [
        inst.get_replay_topk(s, K, default_compute_topk=_topk)[1] for inst, s in zip(instances, scores, strict=True)
    ]


def _scores(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 6, generator=g) for _ in range(2)]  # 3 tokens, 6 experts, per layer


def _free(scores) -> list[torch.Tensor]:
    return [torch.topk(s, K, dim=-1)[1] for s in scores]


ENGINE = {0: [torch.tensor([[5, 4], [3, 2], [1, 0]])] * 2, 1: [torch.tensor([[0, 1], [2, 3], [4, 5]])] * 2}
MICRO_BATCHES = [{"id": 0}, {"id": 1}]


def _run_step(mode, instances):
    strategy = build_replay_strategy(mode, RoutingRecorder(RoutingReplay(instances)), lambda mb: ENGINE[mb["id"]])
    old_scores, new_scores = [_scores(0), _scores(1)], [_scores(2), _scores(3)]  # the policy moved
    with strategy.old_pass(MICRO_BATCHES) as old_pass:
        old_routed = [_forward(instances, s, old_pass.before_forward) for s in old_scores]
    routing = OldPassRouting(strategy.old_policy_routing(old_pass), old_pass.routing)
    with strategy.update(MICRO_BATCHES, lambda: routing.old_policy_routing, record=False) as update:
        new_routed = [_forward(instances, s, update.before_forward) for s in new_scores]
    return strategy, routing, old_scores, new_scores, old_routed, new_routed


def _equal(a, b):
    return all(torch.equal(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def test_none_records_the_old_pass_and_routes_freely(instances):
    strategy, routing, old_scores, new_scores, old_routed, new_routed = _run_step("none", instances)
    assert _equal(old_routed, [_free(s) for s in old_scores])
    assert _equal(routing.old_policy_routing, old_routed) and _equal(routing.trainer_routing, old_routed)
    assert _equal(new_routed, [_free(s) for s in new_scores])
    assert not strategy.replays_in_training


def test_old_policy_replays_what_the_old_pass_recorded(instances):
    strategy, routing, old_scores, new_scores, old_routed, new_routed = _run_step("old_policy", instances)
    assert _equal(routing.old_policy_routing, [_free(s) for s in old_scores])
    assert _equal(new_routed, old_routed)  # the moved policy routes with the old experts
    assert not _equal(new_routed, [_free(s) for s in new_scores])
    assert strategy.replays_in_training


def test_rollout_replays_the_engine_everywhere_and_observes_the_old_pass(instances):
    strategy, routing, _, _, old_routed, new_routed = _run_step("rollout", instances)
    engine = [ENGINE[mb["id"]] for mb in MICRO_BATCHES]
    assert _equal(old_routed, engine) and _equal(new_routed, engine)
    assert routing.old_policy_routing is None
    assert _equal(routing.trainer_routing, engine)  # measured in the replaying forward, not assumed
    assert strategy.replays_in_training


def test_restore_gives_megatron_its_own_methods_back(instances):
    replay = RoutingReplay(instances)
    assert all("record_indices" in vars(inst) for inst in instances)
    replay.start_recording()
    replay.restore()
    for inst in instances:
        assert "record_indices" not in vars(inst) and "get_replay_topk" not in vars(inst)
        assert inst.router_replay_action is None
    scores = _scores(0)
    instances[0].set_router_replay_action(replay.action.RECORD)
    _forward(instances, scores)
    assert torch.equal(instances[0].recorded_topk_idx, _free(scores)[0])  # megatron's own record_indices


def test_mode_table_and_unknown_mode():
    assert [replays(m) for m in ("none", "old_policy", "rollout")] == [False, True, True]
    assert [needs_engine_routing(m) for m in ("none", "old_policy", "rollout")] == [False, False, True]
    assert [needs_trainer_old_pass(m) for m in ("none", "old_policy", "rollout")] == [False, True, False]
    for helper in (replays, needs_engine_routing, needs_trainer_old_pass):
        with pytest.raises(ValueError, match="routing.replay='old' is unknown"):
            helper("old")
    with pytest.raises(ValueError, match="routing.replay='old' is unknown; valid: none, old_policy, rollout"):
        build_replay_strategy("old", RoutingRecorder(None), lambda mb: [])
