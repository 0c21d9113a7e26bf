"""End-to-end: streaming rollout with in-flight weight updates (``rollout.inflight_update_mode=in_place``) through
the real training loop on the tiny MoE, with R3 on. Responses are long and the trainer quick (one update per step),
so the producer is mid-round when a weight sync comes: the sync lands in that round, and the samples it lands in
hold tokens of two versions. Under ``in_place`` each position keeps the routing row of the forward that computed
it, so the trainer's replay of those rows has zero engine-vs-trainer routing mismatch on every step."""

from __future__ import annotations

import math

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import FAST, train_worker

pytestmark = pytest.mark.e2e

K = 2
INFLIGHT = FAST + [
    "trainer.steps=3",
    "rollout.max_new_tokens=48",  # long responses, decoded two rows at a time: a round outlasts a train step
    "rollout.embedded.max_batch_size=2",
    "algorithm=grpo_rollout_routing_replay",
    "rollout.async_rollout=true",
    f"rollout.max_staleness={K}",
    "rollout.inflight_update_mode=in_place",
    "algorithm.mismatch.correction=decoupled",
    "algorithm.loss.entropy_coef=0.01",  # a gradient even when every group is degenerate
]


def test_in_place_updates_land_inside_rounds_and_r3_replays_every_tokens_routing(tmp_path):
    (metrics,) = run_distributed(train_worker, 1, INFLIGHT, str(tmp_path), timeout=600)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["routing/rollout_vs_train_changed_frac"] == 0.0
        assert m["routing/rollout_vs_train_changed_any_frac"] == 0.0
        assert 0.0 <= m["async/staleness_max"] <= K
        assert m["async/groups_dropped"] == 0.0  # wait: the gate holds the producer within the bound
        assert math.isfinite(m["loss/policy"])
    # some trained samples hold tokens of two versions: an update landed inside their generation
    assert sum(m["async/samples_spanning_versions"] for m in metrics) > 0
