"""Over-sampling with ``rollout.partial=continue`` and an agent in the real trainer (issue 61): trajectories
cut between turns are carried into the next step and continued on the new weights, Routing Replay (R3)
replays every token's own rows, and a run stopped with carried trajectories and resumed equals the
uninterrupted run step by step (their turns, routing rows and the embedded engine's KV cache are in the
checkpoint). (Carrying one trajectory across a weight update, against an uninterrupted one:
``tests/unit/rollout/agents/test_carried_trajectories.py``.)"""

from __future__ import annotations

import math

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import train_worker, without_time

pytestmark = pytest.mark.e2e

# 1 to 3 turns a trajectory, by its prompt; 2x the groups a step trains are started
BASE = [
    "model=tiny",
    "task=calculator_add",
    "task.min_digits=4",
    "task.max_digits=6",
    "rollout.max_new_tokens=4",
    "rollout.agent.name=import:gspo_megatron.testing.agents:calls_the_calculator_by_the_prompt",
    "rollout.agent.max_tokens=40",
    "rollout.agent.max_wait_s=30",  # every turn joins one engine call: the cut falls after the same turns each run
    "rollout.group_size=2",
    "trainer.prompts_per_step=4",
    "trainer.micro_batch_size=4",
    "trainer.steps=4",
    "trainer.eval_every=0",
    "rollout.over_sample=2",
    "rollout.partial=continue",
    "routing.replay=rollout",
    "algorithm=grpo_rollout_routing_replay",
    "trainer.old_log_probs=trainer",
]


def test_carried_trajectories_train_with_their_own_routing_and_resume_exactly(tmp_path):
    (full,) = run_distributed(train_worker, 1, BASE, str(tmp_path / "full"))
    run_distributed(train_worker, 1, BASE + ["trainer.stop_after_steps=2"], str(tmp_path / "resumed"))
    (resumed,) = run_distributed(train_worker, 1, BASE + ["checkpoint.resume=true"], str(tmp_path / "resumed"))
    assert [m["step"] for m in full] == [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert [_nan_as_none(m) for m in without_time(full)] == [_nan_as_none(m) for m in without_time(resumed)]
    # trajectories were cut with turns and carried, and trained with tokens of an older version
    assert sum(m["rollout/partial/aborted_samples"] for m in full[:2]) > 0
    assert sum(m["rollout/partial/groups_carried_in"] for m in full[1:]) > 0
    assert max(m["rollout/partial/stale_token_frac"] for m in full[1:]) > 0
    for step in full:
        assert step["agent/errors"] == 0  # no continued agent asked after other tokens than recorded
        # the engine's rows against megatron's routing on every position, carried turns' (older weights) too
        assert step["routing/rollout_vs_train_changed_frac"] == 0.0


def _nan_as_none(metrics: dict) -> dict:
    """A turn no trajectory reached reports NaN (docs/agents.md), which equals nothing, itself included."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()}
