"""The main job with ``rollout=sglang`` on the tiny task, 12 steps, attached to two live servers, colocated.

Two servers: the session's and a second one this test launches. Each prompt's group goes to one server,
groups spread by load, and every sample records the server that made it (``rollout/servers_used`` is 2
per step); R3's routes come back per sample from whichever server produced them, so the routing
mismatch stays exactly zero on both. Once step ``KILL_AFTER`` is logged the second server is killed:
whatever the trainer was doing (generating, syncing, releasing), its requests go to the survivor and it
is dropped from the hand-over and the syncs; the run finishes its 12 steps on one server.

Colocated placement (``rollout.placement=colocated``, ``loop/colocation.py``) as slime and verl run by
default: after each generation the server releases its memory (``/release_memory_occupation``) and the
trainer takes the device, before each weight sync the trainer frees its gradient buffers and the server
resumes (``/resume_memory_occupation``); the weights go in by tensor handles (``/update_weights_from_tensor``,
shared memory on CPU). On CPU SGLang's memory saver is its no-op (``--enable-memory-saver`` needs CUDA and
torch-memory-saver): what is checked is the protocol -- a release and a resume in every step, answered by
the real server -- and the outputs. GRPO with rollout routing replay (R3): the trainer replays the experts
the SGLang server reported.
- it learns: the reward of the last 4 steps is above that of the first 4 by more than 0.1 (a server whose
  weights the syncs never reached would keep sampling the initial policy's reward, about 0.02). Twelve
  steps at a constant LR (issue 65: 20 on the cosine schedule took the CPU server 180 s of CI's main leg):
  with the embedded engine the same job's reward goes 0.02 -> 0.38 over them, first 4 steps 0.02, last 4
  0.28, the margin the 20 cosine-decayed steps had (first 5 0.04, last 5 0.34);
- the engine-vs-trainer log-prob mismatch is real (SGLang's CPU kernels vs Megatron's fp32) and
  nonzero at every step;
- the routing mismatch is exactly zero at every step: under R3 the trainer routes every token as
  the server did (observed in Megatron's top-k, ``routing/rollout_vs_train_changed_frac``).
Weights reach the server by tensor handles at every step (no disk fallback); the distributed path over
gloo is seen live in ``test_live_engine.py``.
Runs after the engine tests (file order): it leaves trained weights on the session's server.
"""

from __future__ import annotations

import threading
import time

from support.live_server import LIVE_KEY_ENV, attached_run_overrides, launch_live_server

from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import TINY_JOB, train_worker

STEPS = 12
KILL_AFTER = 4  # the second server is killed once this step's metrics are written
EDGE = 4  # the learning check compares the mean reward of the first and the last EDGE steps
KILL_DEADLINE_S = 600.0  # the wait for that step (a hang fails the test, it does not wait forever)
MISMATCH = "mismatch/abs_log_prob_diff_mean"
ROUTING_CHANGED = "routing/rollout_vs_train_changed_frac"


def test_twelve_colocated_steps_with_sglang_learn_with_zero_routing_mismatch_under_r3(
    live_engine, tiny_checkpoint, tmp_path
):
    (url,) = live_engine.server_urls
    second = launch_live_server(tiny_checkpoint, tmp_path / "second", "live_second")
    killer = threading.Thread(target=_kill_after_step, args=(second, tmp_path / "metrics.jsonl"), daemon=True)
    killer.start()
    try:
        metrics = _train_against([url, *second.server_urls], tiny_checkpoint, tmp_path)
    finally:
        second.shutdown()
        killer.join(timeout=60)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:EDGE]) / EDGE, sum(rewards[-EDGE:]) / EDGE
    print(
        f"live training: reward first {EDGE} {first:.3f} last {EDGE} {last:.3f}: {[round(r, 3) for r in rewards]}; "
        f"mismatch "
        f"{[round(m[MISMATCH], 4) for m in metrics]}; routing changed {[m[ROUTING_CHANGED] for m in metrics]}"
    )
    assert last > first + 0.1, f"reward did not rise: {rewards}"
    assert all(m[MISMATCH] > 0 for m in metrics)
    assert all(m[ROUTING_CHANGED] == 0.0 for m in metrics)
    used = [m["rollout/servers_used"] for m in metrics]
    assert used[:KILL_AFTER] == [2.0] * KILL_AFTER  # samples from both servers until the kill
    assert used[-5:] == [1.0] * 5 and sorted(used, reverse=True) == used  # then from the survivor only
    # one release after the generation and one resume before the weight sync, in every step
    assert [(m["colocation/engine_releases"], m["colocation/engine_resumes"]) for m in metrics] == [
        (float(step), float(step)) for step in range(1, STEPS + 1)
    ]


def _kill_after_step(server: SGLangEngine, metrics_file) -> None:
    """Kill ``server`` once ``KILL_AFTER`` steps are in the run's metrics (waits on the file, bounded)."""
    deadline = time.monotonic() + KILL_DEADLINE_S
    while time.monotonic() < deadline:
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= KILL_AFTER:
            server.shutdown()
            return
        time.sleep(0.1)


def _train_against(urls: list[str], tiny_checkpoint, tmp_path) -> list[dict]:
    overrides = [
        "rollout=sglang",
        "algorithm=grpo_rollout_routing_replay",
        "routing.kinds=[rollout_vs_train]",
        f"trainer.steps={STEPS}",
        "optimizer.decay_style=constant",  # the full LR to the last step: 12 steps learn what 20 cosine ones did
        "trainer.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.charts=false",  # the numbers are what is checked
        # the tiny checkpoint's model on the one-token task (+experiment=max_digit_one_token), large groups
        *TINY_JOB,
        "rollout.group_size=16",
        "optimizer.lr=3e-3",
        "rollout.sglang.mode=attach",
        f"rollout.sglang.api_key_env={LIVE_KEY_ENV}",
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


def test_a_multi_turn_agent_job_runs_against_sglang_with_the_routing_exact_on_every_turn(
    live_engine, tiny_checkpoint, tmp_path
):
    """The calculator task's multi-turn job (issue 61) with ``rollout=sglang``: every trajectory three turns with
    two calculator answers inserted (``testing/agents.py``), each turn a request continuing the trajectory on
    the server that made its first; R3 replays the rows spliced per turn, and the trainer routes every
    position of every turn as the server did. Runs last: it leaves trained weights on the server."""
    (url,) = live_engine.server_urls
    overrides = [
        "rollout=sglang",
        "algorithm=grpo_rollout_routing_replay",
        "routing.kinds=[rollout_vs_train]",
        "model=tiny",
        "task=calculator_add",
        "rollout.max_new_tokens=4",
        "rollout.agent.name=import:gspo_megatron.testing.agents:calls_the_calculator_twice",
        "rollout.agent.max_tokens=40",
        "trainer.steps=2",
        "trainer.prompts_per_step=4",
        "rollout.group_size=4",
        "trainer.micro_batch_size=16",
        "trainer.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.charts=false",
        *attached_run_overrides(url, tiny_checkpoint, tmp_path),
    ]
    (metrics,) = run_distributed(train_worker, 1, overrides, str(tmp_path), timeout=840)
    assert [m["step"] for m in metrics] == [1, 2]
    for step in metrics:
        assert step["agent/turns_mean"] == 3 and step["agent/tool_calls_mean"] == 2 and step["agent/errors"] == 0
        assert step[ROUTING_CHANGED] == 0.0
        for turn in range(3):
            assert step[f"{ROUTING_CHANGED}/turn_{turn}"] == 0.0
        assert step[MISMATCH] > 0  # SGLang's kernels: the log-prob gap is real, the routing replayed exactly
