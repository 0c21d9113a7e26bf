"""The ratio decomposition through the real trainer (tiny MoE, one step, 2 updates per rollout): under
R2 the loss replays the old routing, so the routing part is exactly 0; without replay it is measured,
and the numbers are the same on one rank and on two expert-parallel ranks (rows split over the
data-parallel group, sums reduced there)."""

from __future__ import annotations

import math

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import FAST, train_worker

pytestmark = pytest.mark.distributed

OVERRIDES = FAST + [
    "trainer.steps=1",
    "trainer.updates_per_rollout=2",
    "rollout.max_new_tokens=6",
    "routing.kinds=[ratio_decomposition]",
    "optimizer.warmup_steps=0",  # the first update must move the weights
    # every response gets its own reward, so the first update moves the weights
    "task.reward=import:gspo_megatron.testing.reward_doubles:varied_by_response",
]


def _decomposition(tmp_path, name: str, extra: list[str], world_size: int = 1) -> dict:
    metrics = run_distributed(train_worker, world_size, OVERRIDES + extra, str(tmp_path / name))[0]
    (step,) = metrics
    return {k: v for k, v in step.items() if k.startswith("ratio_decomp/")}


@pytest.fixture(scope="module")
def free_one_rank(tmp_path_factory):
    return _decomposition(tmp_path_factory.mktemp("free"), "run", ["algorithm=grpo"])


@pytest.mark.timeout(900)
def test_routing_replay_leaves_no_routing_part(tmp_path, free_one_rank):
    replayed = _decomposition(tmp_path, "r2", ["algorithm=grpo_routing_replay"])
    assert replayed["ratio_decomp/token_unchanged_abs_weight"] > 0  # the first update moved the weights
    assert replayed["ratio_decomp/token_unchanged_frac"] == 1.0  # the loss's experts are the old ones
    assert replayed["ratio_decomp/token_unchanged_abs_routing"] == 0.0  # bit-exact replay
    assert replayed["ratio_decomp/token_var_share_routing"] == 0.0
    # the same weights and batch routed freely: experts change and carry a routing part
    assert free_one_rank["ratio_decomp/token_changed_frac"] > 0
    assert free_one_rank["ratio_decomp/token_changed_abs_routing"] > 0
    shares = [free_one_rank[f"ratio_decomp/token_var_share_{p}"] for p in ("routing", "weight", "cross")]
    assert sum(shares) == pytest.approx(1.0)


@pytest.mark.timeout(900)
def test_expert_parallel_ranks_give_the_one_rank_numbers(tmp_path, free_one_rank):
    ep2 = _decomposition(tmp_path, "ep2", ["algorithm=grpo", "parallel=ep2"], world_size=2)
    assert set(ep2) == set(free_one_rank)
    for key, value in free_one_rank.items():
        if math.isnan(value):
            assert math.isnan(ep2[key]), key
        else:
            assert ep2[key] == pytest.approx(value, rel=1e-3, abs=1e-6), key
