"""Every way a verifier can fail costs its one sample and is counted by kind; isolation is the default."""

from __future__ import annotations

import threading

import pytest
import verifier_doubles

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


def test_an_in_process_reward_that_never_returns_is_a_counted_timeout():
    """Issue 63, item 6: ``reward.in_process=true`` with a reward that never returned held the run with no
    output. Now the call gets reward.timeout_s like a worker's: a ``timeout`` failure, a warning that its
    thread is abandoned, and the samples after it are scored."""
    verifier_doubles.RELEASE.clear()
    pool = RewardPool("import:verifier_doubles:blocks_on_bad", RewardConfig(in_process=True, timeout_s=0.2))
    results, finished = [], threading.Event()

    def score() -> None:
        results.extend(pool.score(["7", "bad", "7"], [RECORD] * 3))
        finished.set()

    abandoned = r"'import:verifier_doubles:blocks_on_bad' did not return within reward\.timeout_s=0\.2 s.*abandoned"
    try:
        with pytest.warns(RuntimeWarning, match=abandoned):
            threading.Thread(target=score, daemon=True).start()
            assert finished.wait(60), "score() still held by an in-process reward that never returns, after 60 s"
    finally:
        verifier_doubles.RELEASE.set()  # the abandoned thread returns, its result is dropped
    assert [r.failure for r in results] == [None, "timeout", None]
    assert results[0] == RewardResult(1.0, True, True) and "reward.timeout_s" in results[1].error
    assert pool.stats.failures["timeout"] == 1 and pool.stats.timeouts == 1
    assert pool.score(["7"], [RECORD]) == [RewardResult(1.0, True, True)]  # a fresh thread serves on
    pool.close()


def test_an_in_process_batch_is_one_hand_off_and_a_timeout_runs_no_call_twice():
    """The in-process path hands the thread a whole batch at once (a hand-off per sample cost two thread
    wake-ups each); past a timeout the rest of the batch goes to a fresh thread, and the abandoned one, once
    its call returns, runs none of it: every response is scored exactly once, in order."""
    verifier_doubles.RELEASE.clear()
    verifier_doubles.CALLS.clear()
    pool = RewardPool("import:verifier_doubles:blocks_on_bad", RewardConfig(in_process=True, timeout_s=0.2))
    batch = ["7", "8", "bad", "7", "8"]
    caller = pool._caller
    assert caller is not None
    results, finished = [], threading.Event()

    def score() -> None:
        results.extend(pool.score(batch, [RECORD] * len(batch)))
        finished.set()

    try:
        with pytest.warns(RuntimeWarning, match="abandoned"):
            threading.Thread(target=score, daemon=True).start()
            assert finished.wait(60), "score() did not return within 60 s"
        abandoned = [t for t in threading.enumerate() if t.name == "reward-in-process-0"]
    finally:
        verifier_doubles.RELEASE.set()
    for thread in abandoned:
        thread.join(60)  # its blocked call returns; it must then stop, not score the batch's rest
        assert not thread.is_alive(), "the abandoned reward thread still runs 60 s after its call returned"
    assert [r.failure for r in results] == [None, None, "timeout", None, None]
    assert batch == verifier_doubles.CALLS
    assert caller.handoffs == 2  # the batch, then its rest after the timeout
    many = [str(i % 10) for i in range(256)]
    assert pool.score(many, [RECORD] * 256) == [RewardResult(float(r == "7"), r == "7", True) for r in many]
    assert caller.handoffs == 3
    pool.close()


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


def _returning(**fields) -> PromptRecord:
    return PromptRecord("q", "7", {"result": {"reward": 1.0, "correct": True, "format_ok": True, **fields}})


@pytest.mark.parametrize(
    "field, value, type_name",
    [
        ("correct", "false", "str"),  # bool("false") is True: it used to count as correct, silently
        ("correct", None, "NoneType"),
        ("correct", 2, "int"),
        ("correct", 1.0, "float"),
        ("format_ok", "no", "str"),
        ("reward", "1.0", "str"),  # float("1.0") parses: it used to score 1.0
        ("reward", None, "NoneType"),
        ("reward", [1.0], "list"),
    ],
)
def test_fields_of_the_wrong_type_fail_their_sample_naming_the_field(field, value, type_name):
    pool = RewardPool("import:verifier_doubles:returns_record_fields", RewardConfig(in_process=True))
    [result] = pool.score(["7"], [_returning(**{field: value})])
    assert (result.failure, result.reward, result.correct, result.format_ok) == ("bad_type", 0.0, False, False)
    assert f"RewardResult.{field} is {value!r} ({type_name}); return a" in result.error
    assert pool.stats.failures["bad_type"] == 1 and pool.stats.errors == 1  # reward/errors/bad_type counts it


def test_bools_and_the_integers_0_and_1_are_accepted():
    np = pytest.importorskip("numpy")
    pool = RewardPool("import:verifier_doubles:returns_record_fields", RewardConfig(in_process=True))
    records = [
        _returning(correct=False, format_ok=True, reward=0),
        _returning(correct=1, format_ok=0),
        _returning(correct=np.True_, format_ok=np.int64(0), reward=np.float32(0.5)),
    ]
    results = pool.score(["7"] * 3, records)
    assert results == [
        RewardResult(0.0, False, True),
        RewardResult(1.0, True, False),
        RewardResult(0.5, True, False),
    ]
    assert all(type(r.correct) is bool and type(r.format_ok) is bool for r in results)
    assert pool.stats.errors == 0


def test_a_reward_models_one_element_tensor_or_array_is_a_reward_and_a_longer_one_is_not():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    pool = RewardPool("import:verifier_doubles:returns_record_fields", RewardConfig(in_process=True))
    records = [
        _returning(reward=torch.tensor(0.25)),
        _returning(reward=np.array(0.75)),
        _returning(reward=torch.ones(2)),
    ]
    results = pool.score(["7"] * 3, records)
    assert [r.reward for r in results[:2]] == [0.25, 0.75] and results[2].failure == "bad_type"
    assert "RewardResult.reward is tensor([1., 1.])" in results[2].error
