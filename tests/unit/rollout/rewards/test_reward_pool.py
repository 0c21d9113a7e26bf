"""RewardPool with real worker processes (forkserver). Misbehaving verifiers live in verifier_doubles.py."""

import time

import pytest

from gspo_megatron.core.registry import UnknownNameError
from gspo_megatron.core.threads import usable_cores
from gspo_megatron.rollout.data import PromptRecord
from gspo_megatron.rollout.rewards import RewardConfig, RewardPool, RewardResult

RECORD = PromptRecord("q", "7")
OK = RewardResult(reward=1.0, correct=True, format_ok=True)
WRONG = RewardResult(reward=0.0, correct=False, format_ok=True)


def _pool(double, **overrides):
    config = dict(num_workers=2, timeout_s=1.0, startup_timeout_s=60.0)
    config.update(overrides)
    return RewardPool(f"import:verifier_doubles:{double}", RewardConfig(**config))


def test_hanging_verifier_costs_one_sample_and_pool_recovers():
    with _pool("hangs_on_bad") as pool:
        start = time.monotonic()
        results = pool.score(["7", "bad", "8", "7", "7"], [RECORD] * 5)
        elapsed = time.monotonic() - start
        assert [results[i] for i in (0, 2, 3, 4)] == [OK, WRONG, OK, OK]
        assert results[1].reward == 0.0 and "timed out after 1.0 s" in results[1].error
        assert 1.0 <= elapsed < 10.0  # waited for the timeout, not for the hour-long sleep
        assert (pool.stats.timeouts, pool.stats.restarts, pool.stats.errors, pool.stats.scored) == (1, 1, 1, 5)
        # the pool still works afterwards, including a second hang
        assert pool.score(["7", "8"], [RECORD] * 2) == [OK, WRONG]
        again = pool.score(["bad", "7"], [RECORD] * 2)
        assert again[1] == OK and "timed out" in again[0].error
        assert pool.stats.timeouts == 2 and pool.stats.restarts == 2


def test_raising_verifier_keeps_its_worker():
    with _pool("raises_on_bad", num_workers=1) as pool:
        results = pool.score(["bad", "7", "bad"], [RECORD] * 3)
        assert results[1] == OK
        for failed in (results[0], results[2]):
            assert failed.reward == 0.0 and failed.error == "verifier raised ZeroDivisionError: verifier bug"
        assert pool.stats.errors == 2 and pool.stats.restarts == 0  # exceptions do not kill the worker


def test_verifier_that_kills_its_process():
    with _pool("kills_process_on_bad") as pool:
        results = pool.score(["7", "bad", "7", "8"], [RECORD] * 4)
        assert [results[i] for i in (0, 2, 3)] == [OK, OK, WRONG]
        assert results[1].error == "verifier process died (exit code -9)"
        assert (pool.stats.crashes, pool.stats.restarts) == (1, 1)
        assert pool.score(["7"], [RECORD]) == [OK]


def test_wrong_return_type_is_an_error_not_a_crash():
    with _pool("returns_str", num_workers=1) as pool:
        (result,) = pool.score(["7"], [RECORD])
        assert result.reward == 0.0 and result.failure == "bad_type"
        assert "verifier returned str ('1.0'), expected a RewardResult, a real number" in result.error


def test_worker_that_cannot_start_fails_the_pool_loudly():
    pool = _pool("fails_on_import_in_worker", num_workers=1)
    try:
        with pytest.raises(RuntimeError, match="this verifier cannot start"):
            pool.score(["7"], [RECORD])
    finally:
        pool.close()


def test_in_process_fast_path_and_builtin_reward():
    record = PromptRecord("max 3817=", "8", {"stop_strings": ["<eos>"], "answer_pattern": r"\d+"})
    in_process = RewardPool("exact_match", RewardConfig(in_process=True))
    results = in_process.score(["8<eos>", "3<eos>", "x"], [record] * 3)
    assert [r.reward for r in results] == [1.0, 0.0, 0.0]
    with RewardPool("exact_match", RewardConfig(num_workers=1)) as workers:
        assert workers.score(["8<eos>", "3<eos>", "x"], [record] * 3) == results
    raising = RewardPool("import:verifier_doubles:raises_on_bad", RewardConfig(in_process=True))
    assert "ZeroDivisionError" in raising.score(["bad"], [RECORD])[0].error


def test_pool_argument_errors():
    with pytest.raises(ValueError, match="start_method"):
        RewardPool("exact_match", RewardConfig(start_method="fork"))
    with pytest.raises(UnknownNameError, match="valid names"):
        RewardPool("exact", RewardConfig(in_process=True))
    pool = RewardPool("exact_match", RewardConfig(in_process=True))
    with pytest.raises(ValueError, match="2 responses but 1 records"):
        pool.score(["a", "b"], [RECORD])
    closed = _pool("raises_on_bad", num_workers=1)
    closed.close()
    closed.close()  # safe twice
    with pytest.raises(RuntimeError, match="closed"):
        closed.score(["7"], [RECORD])


def test_a_reward_worker_imports_no_torch():
    """What a worker process imports (the pool module with its target, the reward registry, a
    built-in verifier) stays torch-free: workers start in ~0.1 s instead of importing the package."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from gspo_megatron.rollout.rewards.pool import _worker_main\n"
        "from gspo_megatron.rollout.rewards.registry import resolve_reward\n"
        "resolve_reward('last_number')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_plain_float_reward_scores_in_workers_correct_when_positive():
    """Issue 64: a reward returning a float, as TRL's reward functions do, was refused ("verifier returned
    float, expected RewardResult"): every sample scored 0 as a bad_type failure."""
    with _pool("plain_float", num_workers=1) as pool:
        results = pool.score(["7", "8", "x"], [RECORD] * 3)
        assert results == [
            RewardResult(1.0, True, True),
            RewardResult(0.1, True, True),  # any positive reward counts as correct
            RewardResult(-1.0, False, True),
        ]
        assert pool.stats.errors == 0


def test_a_plain_bool_reward_scores_in_workers():
    with _pool("plain_bool", num_workers=1) as pool:
        assert pool.score(["7", "8"], [RECORD] * 2) == [OK, WRONG]
        assert pool.stats.errors == 0


def test_plain_values_in_process_nonfinite_and_none_fail_their_sample():
    pool = RewardPool("import:verifier_doubles:plain_by_response", RewardConfig(in_process=True))
    results = pool.score(["int", "nan", "inf", "none"], [RECORD] * 4)
    assert results[0] == RewardResult(1.0, True, True)
    assert [r.failure for r in results] == [None, "nonfinite", "nonfinite", "bad_type"]
    assert "verifier returned NoneType (None), expected a RewardResult" in results[3].error


@pytest.mark.slow
@pytest.mark.skipif(usable_cores() < 2, reason="one core: one thread is also torch's own default")
def test_a_reward_worker_computes_with_one_thread(monkeypatch):
    """Issue 65: reward workers are single-threaded by the thread rule (core/threads.py), so several of
    them beside the trainer do not each start a team of every core's threads. Spawned, so the worker
    has this environment without OMP_NUM_THREADS (a fork server would keep the one it started with)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with _pool("reports_its_threads", num_workers=1, start_method="spawn", timeout_s=60.0) as pool:
        (result,) = pool.score(["7"], [RECORD])
    assert result.error is None and result.reward == 1.0
