"""The main job with ``rollout=sglang`` on the tiny task, 20 steps, attached to the live server.

GRPO with rollout routing replay (R3): the trainer replays the experts the SGLang server reported.
- it learns: the reward of the last steps is above that of the first ones;
- the engine-vs-trainer log-prob mismatch is real (SGLang's CPU kernels vs Megatron's fp32) and
  nonzero at every step;
- the routing mismatch is exactly zero at every step: under R3 the trainer routes every token as
  the server did (observed in Megatron's top-k, ``routing/rollout_vs_train_changed_frac``).
Weights reach the server by the distributed path over gloo at every step (no disk fallback).
Runs after the engine tests (file order): it leaves trained weights on the session's server.
"""

from __future__ import annotations

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import TINY_JOB, train_worker

STEPS = 20
MISMATCH = "mismatch/abs_log_prob_diff_mean"
ROUTING_CHANGED = "routing/rollout_vs_train_changed_frac"


def test_twenty_steps_with_sglang_learn_with_zero_routing_mismatch_under_r3(live_engine, tiny_checkpoint, tmp_path):
    (url,) = live_engine.server_urls
    overrides = [
        "rollout=sglang",
        "algorithm=grpo_rollout_routing_replay",
        "routing.kinds=[rollout_vs_train]",
        f"trainer.steps={STEPS}",
        "trainer.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.charts=false",  # the numbers are what is checked
        # the tiny checkpoint's model on the one-token task (+experiment=max_digit_one_token), large groups
        *TINY_JOB,
        "rollout.group_size=16",
        "optimizer.lr=3e-3",
        "rollout.sglang.mode=attach",
        f"rollout.sglang.urls=[{url}]",
        f"rollout.sglang.model_path={tiny_checkpoint}",
        f"rollout.sglang.disk_sync_dir={tmp_path / 'disk_sync'}",
        "rollout.sglang.weight_sync=distributed",
        "rollout.sglang.weight_sync_backend=gloo",
        "rollout.sglang.weight_sync_group_name=live_training",
        "rollout.sglang.fallback_to_disk=false",
        "rollout.sglang.pause_mode=abort",
        "rollout.sglang.request_timeout_s=600",
    ]
    (metrics,) = run_distributed(
        train_worker, 1, overrides, str(tmp_path), timeout=840
    )  # below pytest's 900 s: a hang reports the rank's traceback
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(
        f"live training: reward first 5 {first:.3f} last 5 {last:.3f}; mismatch "
        f"{[round(m[MISMATCH], 4) for m in metrics]}; routing changed {[m[ROUTING_CHANGED] for m in metrics]}"
    )
    assert last > first + 0.1, f"reward did not rise: {rewards}"
    assert all(m[MISMATCH] > 0 for m in metrics)
    assert all(m[ROUTING_CHANGED] == 0.0 for m in metrics)
