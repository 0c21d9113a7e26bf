"""Over-sampling with ``rollout.partial=continue`` in the real trainer: groups carried between steps are
part of the checkpoint, so a run stopped after step 1 and resumed equals the uninterrupted run step by step
(what is carried into step 2 was written with step 1's checkpoint); the carried samples' tokens train one
version late and the metrics say so. (Stopping and continuing unfinished samples on the engine:
``tests/unit/rollout/agents/test_partial_rollout.py``;
on a long tail: ``tools/bench_rl_step.py --compare-over-sample``.)"""

from __future__ import annotations

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import train_worker, without_time

pytestmark = pytest.mark.e2e

# 2x the groups the step trains are started; the tiny random model runs every sample to its 8 tokens, so
# the step's groups and the others complete together and the others are carried whole
BASE = [
    "model=tiny",
    "task=max_digit",
    "rollout.max_new_tokens=8",
    "rollout.group_size=2",
    "trainer.prompts_per_step=8",
    "trainer.steps=4",
    "trainer.eval_every=0",
    "rollout.over_sample=2",
    "rollout.partial=continue",
    "algorithm.loss.entropy_coef=0.01",
]


def test_carried_groups_resume_exactly(tmp_path):
    (full,) = run_distributed(train_worker, 1, BASE, str(tmp_path / "full"))
    run_distributed(train_worker, 1, BASE + ["trainer.stop_after_steps=1"], str(tmp_path / "resumed"))
    (resumed,) = run_distributed(train_worker, 1, BASE + ["checkpoint.resume=true"], str(tmp_path / "resumed"))
    assert [m["step"] for m in full] == [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert without_time(full) == without_time(resumed)
    assert full[0]["rollout/partial/groups_carried_out"] == 8.0
    assert full[1]["rollout/partial/groups_carried_in"] == 8.0  # step 2 trains what step 1 left
    assert full[1]["rollout/partial/stale_token_frac"] == 1.0 and full[1]["rollout/partial/stale_tokens_age_1"] > 0
