"""The main job with ``rollout=sglang`` on the tiny task, 20 steps, attached to two live servers, colocated.

Two servers: the session's and a second one this test launches. Each prompt's group goes to one server,
groups spread by load, and every sample records the server that made it (``rollout/servers_used`` is 2
at every step); R3's routes come back per sample from whichever server produced them, so the routing
mismatch stays exactly zero on both.

Colocated placement (``rollout.placement=colocated``, ``trainer/colocation.py``) as slime and verl run by
default: after each generation the server releases its memory (``/release_memory_occupation``) and the
trainer takes the device, before each weight sync the trainer frees its gradient buffers and the server
resumes (``/resume_memory_occupation``); the weights go in by tensor handles (``/update_weights_from_tensor``,
shared memory on CPU). On CPU SGLang's memory saver is its no-op (``--enable-memory-saver`` needs CUDA and
torch-memory-saver): what is checked is the protocol -- a release and a resume in every step, answered by
the real server -- and the outputs. GRPO with rollout routing replay (R3): the trainer replays the experts
the SGLang server reported.
- it learns: the reward of the last steps is above that of the first ones;
- the engine-vs-trainer log-prob mismatch is real (SGLang's CPU kernels vs Megatron's fp32) and
  nonzero at every step;
- the routing mismatch is exactly zero at every step: under R3 the trainer routes every token as
  the server did (observed in Megatron's top-k, ``routing/rollout_vs_train_changed_frac``).
Weights reach the server by tensor handles at every step (no disk fallback); the distributed path over
gloo is seen live in ``test_live_engine.py``.
Runs after the engine tests (file order): it leaves trained weights on the session's server.
"""

from __future__ import annotations

from support.live_server import live_config

from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import TINY_JOB, train_worker

STEPS = 20
MISMATCH = "mismatch/abs_log_prob_diff_mean"
ROUTING_CHANGED = "routing/rollout_vs_train_changed_frac"


def test_twenty_colocated_steps_with_sglang_learn_with_zero_routing_mismatch_under_r3(
    live_engine, tiny_checkpoint, tmp_path
):
    (url,) = live_engine.server_urls
    second = SGLangEngine(
        live_config(
            mode="launch",
            model_path=str(tiny_checkpoint),
            log_dir=str(tmp_path / "second_logs"),
            disk_sync_dir=str(tmp_path / "second_sync"),
            weight_sync_group_name="live_second",
        )
    )
    try:
        metrics = _train_against([url, *second.server_urls], tiny_checkpoint, tmp_path)
    finally:
        second.shutdown()
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
    assert all(m["rollout/servers_used"] == 2.0 for m in metrics)  # samples from both servers, every step
    # one release after the generation and one resume before the weight sync, in every step
    assert [(m["colocation/engine_releases"], m["colocation/engine_resumes"]) for m in metrics] == [
        (float(step), float(step)) for step in range(1, STEPS + 1)
    ]


def _train_against(urls: list[str], tiny_checkpoint, tmp_path) -> list[dict]:
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
        f"rollout.sglang.urls=[{','.join(urls)}]",
        f"rollout.sglang.model_path={tiny_checkpoint}",
        f"rollout.sglang.disk_sync_dir={tmp_path / 'disk_sync'}",
        "rollout.placement=colocated",
        "rollout.sglang.weight_sync=tensor",
        "rollout.sglang.fallback_to_disk=false",
        "rollout.sglang.pause_mode=abort",
        "rollout.sglang.request_timeout_s=600",
    ]
    (metrics,) = run_distributed(
        train_worker, 1, overrides, str(tmp_path), timeout=840
    )  # below pytest's 900 s: a hang reports the rank's traceback
    return metrics
