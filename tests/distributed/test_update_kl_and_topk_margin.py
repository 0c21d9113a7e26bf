"""E1's two new measurements through the real trainer (tiny MoE, one step, GRPO without replay):
``loss/approx_kl_k3_after_one_update`` -- update 1's KL(pi_old || pi_theta), after exactly one optimizer
step -- and the old pass's top-k margins (``routing/topk_margin_*``, the ``update`` record's histogram)."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import FAST, train_worker

pytestmark = pytest.mark.distributed

OVERRIDES = FAST + [
    "algorithm=grpo",
    "trainer.steps=1",
    "trainer.updates_per_rollout=2",
    "rollout.max_new_tokens=6",
    "routing.kinds=[update]",
    "optimizer.warmup_steps=0",  # the first update must move the weights
    "task.reward=import:gspo_megatron.testing.reward_doubles:varied_by_response",
]


@pytest.mark.timeout(600)
def test_kl_after_one_update_and_margins(tmp_path):
    run_dir = tmp_path / "run"
    (step,) = run_distributed(train_worker, 1, OVERRIDES, str(run_dir))[0]
    after_one, mean_over_updates = step["loss/approx_kl_k3_after_one_update"], step["loss/approx_kl_k3"]
    # update 0 runs before any step (its KL is ~0: pi_theta is pi_old), update 1 after one: the mean over
    # both updates lies between, and the KL after one update is the larger
    assert after_one > 0
    assert 0 < mean_over_updates < after_one
    below = [step[f"routing/topk_margin_below_{edge}"] for edge in ("0.001", "0.01", "0.1", "1", "3")]
    assert below == sorted(below) and below[0] >= 0 and below[-1] <= 1
    assert step["routing/topk_margin_mean"] > 0
    (record,) = [
        r for r in map(json.loads, (run_dir / "routing.jsonl").read_text().splitlines()) if r["kind"] == "update"
    ]
    counts = record["topk_margin_counts"]
    assert len(counts) == len(record["changed_frac"]) == len(record["topk_margin_mean"])  # one row per MoE layer
    assert len({sum(row) for row in counts}) == 1  # every layer counts the same tokens


@pytest.mark.timeout(600)
def test_one_update_per_rollout_logs_no_kl_after_one_update(tmp_path):
    overrides = [o for o in OVERRIDES if not o.startswith("trainer.updates_per_rollout")]
    (step,) = run_distributed(train_worker, 1, [*overrides, "trainer.updates_per_rollout=1"], str(tmp_path / "run"))[0]
    assert "loss/approx_kl_k3_after_one_update" not in step
    assert "routing/topk_margin_mean" in step
