"""End-to-end: streaming asynchronous rollout (``rollout.max_staleness=2``) through the real training loop on the
tiny MoE, with R3 on. The trainer is the slow side (two updates per step, each a forward-backward over the whole
batch) and the engine the fast one (one token per response), so the producer runs ahead to the bound. No trained
token is more than k versions old, under ``wait`` nothing is dropped, and every sample replays the routing of
the version that sampled it: zero engine-vs-trainer routing mismatch."""

from __future__ import annotations

import math

import pytest

from gspo_megatron.policy.checkpoint.store import latest_checkpoint, read_trainer_state
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import FAST, train_worker, without_time

pytestmark = pytest.mark.e2e

K = 2
STREAMING = FAST + [
    "trainer.steps=4",
    "algorithm=grpo_rollout_routing_replay",
    "rollout.async_rollout=true",
    f"rollout.max_staleness={K}",
    "algorithm.mismatch.correction=token_truncate",
    "algorithm.loss.entropy_coef=0.01",  # a gradient even when every group is degenerate
    "trainer.updates_per_rollout=2",
    "trainer.eval_every=2",  # the evaluation generates on the engine between the producer's rounds
]


@pytest.mark.parametrize("mode", ["wait", "drop"])
def test_streaming_trains_no_token_older_than_k_and_replays_each_samples_routing(tmp_path, mode):
    (metrics,) = run_distributed(
        train_worker, 1, STREAMING + [f"rollout.staleness_mode={mode}"], str(tmp_path), timeout=600
    )
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert 0.0 <= m["async/staleness_max"] <= K
        assert m["async/staleness_max"] <= m["step"] - 1  # never older than the run's first weights
        assert (m["async/stale_token_frac"] > 0.0) == (m["async/staleness_max"] > 0.0)
        assert m["routing/rollout_vs_train_changed_any_frac"] == 0.0
        assert 0.0 <= m["time/trainer_idle_frac"] <= 1.0 and 0.0 <= m["time/engine_idle_frac"] <= 1.0
        assert math.isfinite(m["loss/policy"])
        if mode == "wait":
            assert m["async/groups_dropped"] == 0.0
    assert metrics[0]["async/staleness_max"] == 0.0  # the first step's groups start on its own weights
    assert "eval/pass@1" in metrics[1] and "eval/pass@1" in metrics[3]


def test_a_resumed_streaming_run_drops_its_buffer_and_draws_fresh_groups(tmp_path):
    """The resume rule (rollout/streaming.py): the checkpoint holds the next round and how many groups were
    buffered; the resumed run counts those as dropped and trains only groups drawn on its own weights first."""
    run_dir = tmp_path / "run"
    run_distributed(train_worker, 1, STREAMING + ["trainer.stop_after_steps=2"], str(run_dir), timeout=600)
    saved = read_trainer_state(latest_checkpoint(run_dir))["rollout_scheduler"]
    assert saved["next_round"] >= 2 and saved["buffered_groups"] == (saved["next_round"] - 2) * 4  # G = 4
    (metrics,) = run_distributed(train_worker, 1, STREAMING + ["checkpoint.resume=true"], str(run_dir), timeout=600)
    resumed = [m for m in metrics if m["step"] > 2]
    assert [m["step"] for m in resumed] == [3, 4]
    assert resumed[0]["async/groups_dropped_at_resume"] == saved["buffered_groups"]
    assert resumed[0]["async/staleness_max"] == 0.0 and resumed[0]["async/policy_version_min"] == 2.0
    assert resumed[1]["async/groups_dropped_at_resume"] == 0.0


# Weights frozen in effect (optimizer.lr must be > 0; Adam's steps of ~1e-30 vanish in float32 beside any weight
# that is not itself ~0, and change no logged number): every version is the same policy, so what staleness alone
# could change is gone and what is left is the bookkeeping.
FROZEN = FAST + [
    "trainer.steps=4",
    "rollout.max_new_tokens=4",
    "optimizer.lr=1e-30",
    "optimizer.min_lr=0",
    "algorithm.mismatch.correction=decoupled",
]


# The engine-vs-trainer gap of the same weights is float noise (~1e-7 a token), which may differ between two
# processes in its last bits: compared within this bound, every other metric exactly.
FLOAT_NOISE = 1e-6
ENGINE_VS_TRAINER = ("mismatch/", "mismatch_is/")


def test_with_frozen_weights_streaming_trains_exactly_the_synchronous_runs_batches(tmp_path):
    """Issue 66's post hoc check (reports/async_long_tail/README.md): streaming k = 2 trains round s's prompts
    with round s's sampling seed at step s, whole groups with their own advantages, and each token's engine
    log-prob beside it. With frozen weights (every version the same policy) every metric of every step but the
    versions' (the loss and the gradient norm included) then equals the synchronous run's; a round's prompts or
    seed repeated or shifted, or a group mixed into another step would change one. (Which version's log-probs a
    token carries it cannot see: every version is the same policy here.)"""
    (sync,) = run_distributed(
        train_worker, 1, FROZEN + ["rollout.max_staleness=0"], str(tmp_path / "sync"), timeout=600
    )
    streaming_overrides = FROZEN + ["rollout.async_rollout=true", f"rollout.max_staleness={K}"]
    (streaming,) = run_distributed(train_worker, 1, streaming_overrides, str(tmp_path / "k2"), timeout=600)
    # the engine is the fast side (one forward per token, the trainer two updates a step): it runs ahead to k
    assert max(m["async/staleness_max"] for m in streaming) == K
    for sync_step, streaming_step in zip(without_time(sync), without_time(streaming), strict=True):
        exact = {k: v for k, v in sync_step.items() if not k.startswith(("async/", *ENGINE_VS_TRAINER))}
        assert {k: streaming_step[k] for k in exact} == exact  # async/: the versions differ
        noise = {k: v for k, v in sync_step.items() if k.startswith(ENGINE_VS_TRAINER)}
        assert {k: streaming_step[k] for k in noise} == pytest.approx(noise, abs=FLOAT_NOISE)
        assert streaming_step["mismatch_is/masked_frac"] == 0.0
