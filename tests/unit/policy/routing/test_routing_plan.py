"""RoutingPlan: which forward of a step is recorded, and which extra passes run, for every combination
of replay mode and pi_old source (the table in policy/routing/plan.py's docstring)."""

from __future__ import annotations

import pytest

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config
from gspo_megatron.loop.build import policy_settings
from gspo_megatron.policy.policy import routing_plan
from gspo_megatron.policy.routing.config import RoutingConfig
from gspo_megatron.policy.routing.plan import RecordingPass, RoutingPlan
from gspo_megatron.policy.routing.replay import ReplayMode

ALL_KINDS = ["update", "rollout_vs_train", "minibatch", "ratio_decomposition"]


def _plan(replay="none", source="trainer", updates=3, kinds=ALL_KINDS, every=1, has_routers=True):
    return RoutingPlan(
        ReplayMode(replay),
        engine_old_policy=source == "rollout",
        updates=updates,
        has_routers=has_routers,
        diagnostics=RoutingConfig(every_n_steps=every, kinds=kinds),
    )


def _recorded_updates(plan, step=0):
    return [u for u in range(plan.updates) if plan.records_training_forward(u, step)]


def test_which_training_forward_is_recorded():
    assert _recorded_updates(_plan()) == [1]  # the free "update" measurement after one optimizer step
    assert _recorded_updates(_plan(source="rollout")) == [0]  # the old policy's routing: no old pass ran
    assert _recorded_updates(_plan(replay="old_policy")) == []  # replayed forwards do not route freely
    assert _recorded_updates(_plan(replay="rollout", source="rollout")) == []
    assert _recorded_updates(_plan(kinds=["minibatch"])) == []
    assert _recorded_updates(_plan(every=2), step=1) == []
    assert _recorded_updates(_plan(has_routers=False)) == []


@pytest.mark.parametrize(
    ("replay", "source", "updates", "after_first"),
    [
        ("none", "trainer", 3, RecordingPass(False, True)),  # "update" came free from update 1's forward
        ("none", "trainer", 1, RecordingPass(True, False)),  # one update: no free forward, no minibatch
        ("old_policy", "trainer", 3, RecordingPass(True, True)),
        ("rollout", "trainer", 3, RecordingPass(True, True)),
        ("none", "rollout", 3, RecordingPass(True, True)),
    ],
)
def test_recording_passes(replay, source, updates, after_first):
    plan = _plan(replay, source, updates)
    assert plan.recording_pass_after(0, 0) == after_first
    later = plan.recording_pass_after(1, 0)
    assert later == (RecordingPass(False, True) if updates > 1 else None)
    assert _plan(replay, source, updates, kinds=["rollout_vs_train"]).recording_pass_after(0, 0) is None


def test_ratio_decomposition_at_the_last_update_only():
    plan = _plan(updates=3)
    assert [plan.decomposes_ratio(u, 0) for u in range(3)] == [False, False, True]
    assert not _plan(kinds=["update"]).decomposes_ratio(2, 0)


def test_the_policy_reads_the_plan_from_the_config_sections():
    cfg = to_train_config(
        compose(["routing.replay=rollout", "trainer.updates_per_rollout=4", "trainer.old_log_probs=rollout"])
    )
    plan = routing_plan(policy_settings(cfg), has_routers=True)
    assert (plan.routing_replay, plan.updates, plan.diagnostics) == ("rollout", 4, cfg.routing)
    assert plan.replays_in_training and plan.engine_old_policy
    assert not routing_plan(policy_settings(to_train_config(compose([]))), has_routers=False).engine_old_policy
