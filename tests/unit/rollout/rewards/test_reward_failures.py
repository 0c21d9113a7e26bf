"""Every way a verifier can fail costs its one sample and is counted by kind; isolation is the default."""

from __future__ import annotations

import pytest

from gspo_megatron.rollout.data import PromptRecord
from gspo_megatron.rollout.rewards import RewardConfig, RewardPool, RewardResult
from gspo_megatron.rollout.rewards.types import FAILURE_KINDS

RECORD = PromptRecord("q", "7")
RESPONSES = ["7", "raise", "type", "string", "nan", "inf", "hang", "die", "8"]
KINDS = [None, "raised", "bad_type", "bad_type", "nonfinite", "nonfinite", "timeout", "died", None]


def test_each_failure_kind_costs_one_sample_in_workers():
    config = RewardConfig(num_workers=2, timeout_s=1.0, startup_timeout_s=60.0)
    with RewardPool("import:verifier_doubles:misbehaves_by_response", config) as pool:
        assert not pool.in_process  # an import: reward is isolated by default
        results = pool.score(RESPONSES, [RECORD] * len(RESPONSES))
        assert [r.failure for r in results] == KINDS
        assert results[0] == RewardResult(1.0, True, True) and results[-1] == RewardResult(0.0, False, True)
        for result in results[1:-1]:
            assert result.reward == 0.0 and result.error
        assert pool.stats.failures == {
            **{k: 0 for k in FAILURE_KINDS},
            "raised": 1,
            "bad_type": 2,
            "nonfinite": 2,
            "timeout": 1,
            "died": 1,
        }
        assert pool.stats.errors == 7
        assert pool.score(["7"], [RECORD]) == [RewardResult(1.0, True, True)]  # the pool lives on


def test_in_process_conversion_is_guarded():
    pool = RewardPool("import:verifier_doubles:misbehaves_by_response", RewardConfig(in_process=True))
    results = pool.score(["string", "nan", "7"], [RECORD] * 3)
    assert [r.failure for r in results] == ["bad_type", "nonfinite", None]


@pytest.mark.parametrize(
    "name, in_process",
    [
        ("exact_match", True),
        ("last_number", True),
        ("math_verify", False),
        ("import:verifier_doubles:raises_on_bad", False),
    ],
)
def test_only_trivial_builtins_run_in_process_by_default(name, in_process):
    pool = RewardPool(name, RewardConfig(num_workers=1))
    try:
        assert pool.in_process is in_process
    finally:
        pool.close()
