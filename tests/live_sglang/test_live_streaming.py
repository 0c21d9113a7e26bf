"""The streaming mode and in-flight weight updates against the session's REAL SGLang 0.5.23 server on CPU.

- In-flight updates (``SGLangEngine.update_weights_in_flight``, what ``rollout.inflight_update_mode`` sends):
  a request decoding on the server when the update lands. Its tokens after the update carry the new version
  (``Sample.extra["token_versions"]``, from SGLang's ``meta_info.weight_versions`` spans), and each token's
  engine log-prob is the trainer's forward's (transformers' Qwen3-MoE, fp32) of the weights that sampled it:
  ``in_place`` -- the positions fed before the update keep their KV (old weights), the later ones are computed
  by the new weights over it, and the routing rows the server returns are exactly that forward's (R3 exact
  across the update); ``retract`` -- the KV is computed again, so the tokens after the update are the new
  weights' forward of the whole sequence.
- A short streaming run (``rollout.async_rollout=true rollout.max_staleness=2``, R3) through the main job
  attached to the server: the producer thread generates while the trainer trains, the syncs take turns with
  its rounds (or, ``rollout.inflight_update_mode=in_place``, land in the round in flight), no trained token is
  older than k, and the routing difference is zero at every step.
Every test puts the checkpoint's weights back on the server (``conftest.py``).
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import torch
from support.live_server import LIVE_KEY_ENV, attached_run_overrides
from test_live_engine import PROMPTS, TINY, hf_weights

from gspo_megatron.contracts.samples import TOKEN_VERSIONS, SamplingParams
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import TINY_JOB, train_worker

# greedy and long: the request decodes for ~20 s on the CPU server (the update's pause comes within a second of
# the request being seen running), and the trainer-side forward below picks the same tokens
LONG = SamplingParams(temperature=0.0, max_new_tokens=120, stop_token_ids=(), return_routed_experts=True)
RUNNING_BOUND_S = 120.0  # the wait for the server to report the request running
LOG_PROB_TOLERANCE = 0.05  # the server's half-precision kernels vs fp32 (test_live_engine's measured bound)
K = 2
ROUTING_CHANGED = "routing/rollout_vs_train_changed_frac"


def wait_until_running(url: str) -> None:
    """Until the server's load (``GET /v1/loads``) shows a request in its running batch (decoding), bounded."""
    headers = {"Authorization": f"Bearer {os.environ[LIVE_KEY_ENV]}"}
    deadline = time.monotonic() + RUNNING_BOUND_S
    while time.monotonic() < deadline:
        loads = httpx.get(f"{url}/v1/loads", params={"include": "core"}, headers=headers, trust_env=False).json()
        if any(load.get("num_running_reqs", 0) > 0 for load in loads["loads"]):
            return
        threading.Event().wait(0.05)
    raise TimeoutError(f"the server reported no running request within {RUNNING_BOUND_S} s")


def in_flight_sample(engine, weights, version: int, mode: str):
    """One long greedy request of ``PROMPTS[0]``; once it decodes, ``weights`` land in it (pause ``mode``)."""
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(engine.generate([PROMPTS[0]], LONG)[0]), daemon=True)
    worker.start()
    wait_until_running(engine.server_urls[0])
    engine.update_weights_in_flight(weights, version, mode)
    worker.join(600)
    assert not worker.is_alive(), "the request never finished after the update"
    (sample,) = results
    return sample


def forward(checkpoints, ids: list[int], fed_first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer-side forward of ``ids``: positions 0..fed_first-1 by ``checkpoints[0]``, the rest by
    ``checkpoints[1]`` attending to that KV (fed_first = len(ids): one model). Log-probs [len(ids), vocab] and
    sorted top-k experts [len(ids), layers, top_k], fp32."""
    from transformers import Qwen3MoeForCausalLM

    models = [Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for path in checkpoints]
    with torch.no_grad():
        outs = [models[0](torch.tensor([ids[:fed_first]]), use_cache=True, output_router_logits=True)]
        if fed_first < len(ids):
            outs.append(models[1](torch.tensor([ids[fed_first:]]), cache=outs[0].cache, output_router_logits=True))
    log_probs = torch.cat([torch.log_softmax(out.logits[0].float(), dim=-1) for out in outs])
    experts = torch.cat(
        [torch.stack([logits.topk(TINY.top_k, dim=-1).indices for logits in out.router_logits], dim=1) for out in outs]
    )
    return log_probs, experts.sort(-1).values


def token_log_prob_gaps(sample, log_probs: torch.Tensor) -> torch.Tensor:
    """|engine log-prob - trainer log-prob| of every output token."""
    first = len(sample.prompt_ids) - 1  # the position that predicts the first output token
    targets = torch.tensor(sample.output_ids)
    trainer = log_probs[first : first + len(targets)].gather(1, targets[:, None])[:, 0]
    return (torch.as_tensor(sample.output_log_probs).float() - trainer).abs()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_an_in_flight_update_gives_the_later_tokens_the_new_version_and_the_new_weights_log_probs(
    attach, tiny_checkpoint, tmp_path, mode
):
    from support.tiny_checkpoint import write_tiny_checkpoint

    engine = attach(weight_sync="tensor", fallback_to_disk=False)
    new_weights = hf_weights(seed=1)  # built before the request starts: the update comes at once
    engine.update_weights(hf_weights(seed=0), version=200)
    try:
        sample = in_flight_sample(engine, new_weights, 201, mode)
    finally:
        engine.update_weights(hf_weights(seed=0), version=202)
    versions = sample.extra[TOKEN_VERSIONS]
    split = versions.count(200)  # output tokens sampled before the update
    assert 1 <= split < len(versions) and versions == [200] * split + [201] * (len(versions) - split)
    assert sample.weight_version == 200  # the oldest token's
    seed_one = write_tiny_checkpoint(tmp_path / "tiny_hf_seed1", seed=1)  # hf_weights(seed=1) as a checkpoint
    ids = sample.prompt_ids + sample.output_ids[:-1]  # the fed positions
    fed_before = len(sample.prompt_ids) + split - 1  # fed (KV computed) before the update
    if mode == "in_place":  # the KV kept: one forward, the old weights' positions then the new weights'
        log_probs, experts = forward([tiny_checkpoint, seed_one], ids, fed_before)
        rows = sample.routed_experts.sort(-1).values
        assert torch.equal(rows, experts), "the server's rows are not the kept-KV forward's (R3 across the update)"
    else:  # the KV computed again: the new weights' forward of the whole sequence
        log_probs, _ = forward([seed_one], ids, len(ids))
        log_probs[:fed_before] = forward([tiny_checkpoint], ids[:fed_before], fed_before)[0]
    gaps = token_log_prob_gaps(sample, log_probs)
    old_only = token_log_prob_gaps(sample, forward([tiny_checkpoint], ids, len(ids))[0])
    print(
        f"\nlive {mode}: {split} tokens before the update, {len(versions) - split} after; engine-vs-trainer "
        f"|log-prob gap| max {gaps.max():.3g} (before {gaps[:split].max():.3g}, after {gaps[split:].max():.3g}); "
        f"the old weights would give max {old_only[split:].max():.3g} after"
    )
    assert gaps.max() < LOG_PROB_TOLERANCE  # every token: the weights that sampled it
    assert old_only[split:].max() > 10 * LOG_PROB_TOLERANCE  # and the check tells the versions apart


@pytest.mark.parametrize("inflight", ["off", "in_place"])
def test_a_streaming_run_with_r3_trains_no_token_older_than_k_with_zero_routing_difference(
    live_engine, tiny_checkpoint, tmp_path, inflight
):
    """``off``: the syncs take turns with the producer's rounds. ``in_place``: they land in the round in flight
    (``SGLangEngine.update_weights_in_flight``), responses of up to 8 tokens, so a sample may span two versions;
    R3 stays exact either way."""
    (url,) = live_engine.server_urls
    overrides = [
        "rollout=sglang",
        "algorithm=grpo_rollout_routing_replay",
        "routing.kinds=[rollout_vs_train]",
        *TINY_JOB,
        *([] if inflight == "off" else ["rollout.max_new_tokens=8", "algorithm.mismatch.correction=decoupled"]),
        f"rollout.inflight_update_mode={inflight}",
        "trainer.steps=3",
        "trainer.prompts_per_step=4",
        "rollout.group_size=4",
        "trainer.micro_batch_size=16",
        "trainer.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.charts=false",
        "rollout.async_rollout=true",
        f"rollout.max_staleness={K}",
        "rollout.staleness_mode=wait",
        *(["algorithm.mismatch.correction=token_truncate"] if inflight == "off" else []),
        *attached_run_overrides(url, tiny_checkpoint, tmp_path),
    ]
    try:
        (metrics,) = run_distributed(train_worker, 1, overrides, str(tmp_path), timeout=840)
    finally:
        live_engine.update_weights(hf_weights(seed=0), version=210)  # the checkpoint's weights back
    print(
        f"\nlive streaming k={K} inflight={inflight}: spanning samples "
        f"{[m['async/samples_spanning_versions'] for m in metrics]}, staleness max "
        f"{[m['async/staleness_max'] for m in metrics]}, routing changed "
        f"{[m[ROUTING_CHANGED] for m in metrics]}, trainer idle "
        f"{[round(m['time/trainer_idle_frac'], 2) for m in metrics]}"
    )
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert 0.0 <= m["async/staleness_max"] <= min(K, m["step"] - 1)  # no trained token older than k
        assert m["async/groups_dropped"] == 0.0  # wait: the gate held every round within the bound
        assert m[ROUTING_CHANGED] == 0.0  # R3: every sample replays its own version's routing
    assert metrics[0]["async/staleness_max"] == 0.0
