"""The project's SGLangEngine against a real SGLang 0.5.23 server on CPU (launch and attach mode).

What is seen live here (docs/sglang.md lists it):
- /generate with log-probs and routed experts decodes to the shapes the trainer expects, and the
  numbers agree with the reference forward of the same checkpoint (transformers' Qwen3-MoE, fp32);
- weight sync by disk, by the distributed path over gloo and by tensor handles (shared memory): other
  weights change the greedy outputs,
  the checkpoint's weights restore them exactly;
- pause/continue around an update while a request is in flight;
- over-sampling: rows stopped by ``/abort_request`` once enough groups are complete answer with their
  tokens, and continue from them;
- fail fast: without the begin/end bracket the server refuses the bucket, and the engine raises the
  server's message within 30 s although the collective timeout is 300 s.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from gspo_megatron.contracts.samples import FinishReason, SamplingParams
from gspo_megatron.policy.models.config import preset
from gspo_megatron.rollout.sglang.engine import SGLangEngine, WeightSyncError
from gspo_megatron.testing.model_fixtures import random_hf_state

TINY = preset("tiny")
PROMPTS = [[20, 5, 9, 13, 7, 3], [21, 11, 4, 6], [22, 8, 8, 12, 10]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, return_routed_experts=True)
FAIL_FAST_BOUND_S = 30.0  # issue 27's bound for a refused distributed update


def hf_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's weights (seed 0, as tiny_checkpoint wrote them) or other ones."""
    return list(random_hf_state(TINY, seed=seed).items())


def greedy_outputs(engine: SGLangEngine) -> list[tuple[list[int], list[float]]]:
    """Greedy outputs, one prompt at a time: a batch of one computes the same way every time."""
    samples = [engine.generate([prompt], GREEDY)[0][0] for prompt in PROMPTS]
    return [(sample.output_ids, torch.as_tensor(sample.output_log_probs).tolist()) for sample in samples]


def changes_and_reverts(engine: SGLangEngine, first_version: int) -> None:
    """Other weights (version ``first_version``) change the greedy outputs; the checkpoint's weights
    (the next version) restore them exactly."""
    before = greedy_outputs(engine)
    engine.update_weights(hf_weights(seed=1), version=first_version)
    perturbed = greedy_outputs(engine)
    engine.update_weights(hf_weights(seed=0), version=first_version + 1)
    assert perturbed != before
    assert greedy_outputs(engine) == before


def reference_forward(checkpoint, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of every next token and the top-k experts of every token, per layer, in fp32."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    log_probs = torch.log_softmax(out.logits[0].float(), dim=-1)
    experts = torch.stack([logits.topk(TINY.top_k, dim=-1).indices for logits in out.router_logits], dim=1)
    return log_probs, experts  # [tokens, vocab], [tokens, layers, top_k]


def test_generate_decodes_log_probs_and_routed_experts_as_the_trainer_reads_them(live_engine, tiny_checkpoint):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, return_routed_experts=True)
    groups = live_engine.generate(PROMPTS, params)
    assert [len(group) for group in groups] == [2, 2, 2]
    worst_log_prob, compared, same_experts, rows = 0.0, 0, 0, 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for sample in group:
            assert sample.prompt_ids == prompt and 1 <= len(sample.output_ids) <= 6
            assert sample.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
            assert len(sample.output_log_probs) == len(sample.output_ids)
            tokens = prompt + sample.output_ids
            assert sample.routed_experts is not None and sample.routed_experts.dtype == torch.int32
            assert tuple(sample.routed_experts.shape) == (len(tokens) - 1, TINY.num_layers, TINY.top_k)
            assert int(sample.routed_experts.min()) >= 0 and int(sample.routed_experts.max()) < TINY.num_experts
            log_probs, experts = reference_forward(tiny_checkpoint, tokens[:-1])
            # experts are unsorted within the top-k: compare the sets, per token and layer
            same = (sample.routed_experts.sort(dim=-1).values == experts.sort(dim=-1).values).all(dim=-1)
            same_experts += int(same.sum())
            rows += same.numel()
            # an output token's log-prob depends on the routing of every token before it: compare the
            # ones whose whole prefix was routed alike (a near-tie that flips changes the rest)
            prefix_alike = same.all(dim=-1).int().cumprod(dim=0).bool()[len(prompt) - 1 :]
            targets = torch.tensor(sample.output_ids)
            reference = log_probs[len(prompt) - 1 :].gather(1, targets[:, None])[:, 0]
            served = torch.as_tensor(sample.output_log_probs)
            difference = (served - reference).abs()[prefix_alike]
            compared += difference.numel()
            worst_log_prob = max([worst_log_prob, *difference.tolist()])
    outputs = sum(len(s.output_ids) for group in groups for s in group)
    print(
        f"live: |log p_server - log p_fp32| max {worst_log_prob:.3g} over {compared}/{outputs} tokens "
        f"routed alike; same top-k {same_experts}/{rows}"
    )
    assert same_experts >= 0.9 * rows  # near-ties may flip under the server's kernels; few do
    assert compared >= outputs // 2
    # The same routing, so only rounding differs: the server runs the fp32 checkpoint in half precision
    # (SGLang's dtype "auto"), and sampled tokens (temperature 1) include unlikely ones, whose log-probs
    # round worst. Measured max over CI runs: 0.007-0.008, then 0.0285 (which failed the old 0.02 bound).
    assert worst_log_prob < 0.05


def test_disk_sync_changes_outputs_and_reverting_restores_them(attach):
    changes_and_reverts(attach(weight_sync="disk"), first_version=1)


def test_distributed_gloo_sync_changes_outputs_and_reverting_restores_them(attach):
    # a failure must show, not be papered over by the disk path
    attach_engine = attach(weight_sync="distributed", fallback_to_disk=False)
    changes_and_reverts(attach_engine, first_version=3)
    (sample,) = attach_engine.generate([PROMPTS[0]], GREEDY)[0]
    assert sample.weight_version == 4


def test_tensor_sync_changes_outputs_and_reverting_restores_them(attach):
    """/update_weights_from_tensor with handles to the trainer's CPU memory (named shared-memory files,
    ``tensor_handles.py``), in buckets smaller than the model, without the disk fallback."""
    attach_engine = attach(weight_sync="tensor", fallback_to_disk=False, weight_bucket_bytes=64 * 1024)
    changes_and_reverts(attach_engine, first_version=5)
    (sample,) = attach_engine.generate([PROMPTS[0]], GREEDY)[0]
    assert sample.weight_version == 6


def test_an_update_pauses_and_continues_a_request_in_flight(attach):
    attach_engine = attach(weight_sync="disk", pause_mode="retract")
    # the update must reach the server while the request decodes: its weights are built before the request
    # starts (building them after let a loaded machine finish 48 tokens first: version 6, the earlier test's), and
    # 200 tokens take the CPU server ~20 s where the disk update's pause comes within a second
    weights = hf_weights(seed=0)
    long_request = SamplingParams(temperature=1.0, max_new_tokens=200, stop_token_ids=())
    finished = threading.Event()
    results: list = []

    def generate():
        results.extend(attach_engine.generate([PROMPTS[1]], long_request)[0])
        finished.set()

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    attach_engine.update_weights(weights, version=5)  # the same weights: only the bracket acts
    assert finished.wait(timeout=600), "the request in flight never finished after continue_generation"
    (sample,) = results
    assert sample.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert sample.weight_version <= 5  # the oldest version it was decoded with (older tests sent some)
    assert attach_engine.generate([PROMPTS[0]], GREEDY)[0][0].weight_version == 5


def test_rows_stop_once_enough_groups_are_complete_and_continue_from_their_tokens(attach):
    """Over-sampling on the real server (``SGLangEngine.generate_rows``): group 0's rows have a budget of 1
    token, group 1's 200; once group 0 is complete the engine aborts group 1's requests by rid and SGLang
    answers each with the tokens it had (finish reason abort, log-probs for each); fed back as a prompt with
    the budget left, a stopped row goes on from its last token."""
    from gspo_megatron.contracts.samples import RowRequest

    engine = attach()
    params = SamplingParams(temperature=1.0, max_new_tokens=200, stop_token_ids=(), return_routed_experts=True)
    rows = [RowRequest(PROMPTS[0], 1, 0)] * 2 + [RowRequest(PROMPTS[1], 200, 1)] * 6
    samples = engine.generate_rows(rows, params, groups_needed=1)
    assert [s.finish_reason for s in samples[:2]] == [FinishReason.LENGTH] * 2
    assert all(len(s.output_ids) == 1 for s in samples[:2])
    # 200 tokens take the CPU server ~20 s: a row of group 1 ends by the model's EOS or by the abort
    assert all(s.finish_reason in (FinishReason.ABORT, FinishReason.STOP) for s in samples[2:])
    aborted = [s for s in samples[2:] if s.finish_reason == FinishReason.ABORT]
    assert aborted and all(len(s.output_log_probs) == len(s.output_ids) < 200 for s in aborted)
    print(f"live: stopped rows kept {[len(s.output_ids) for s in aborted]} tokens")
    stopped = aborted[0]
    more = engine.generate_rows(
        [RowRequest(PROMPTS[1] + stopped.output_ids, 4, 0)], replace(params, max_new_tokens=4), 1
    )
    # it goes on: to its 4-token budget, or sooner by the model's EOS (the server's own stop token)
    assert (more[0].finish_reason, len(more[0].output_ids)) == (FinishReason.LENGTH, 4) or (
        more[0].finish_reason == FinishReason.STOP and 1 <= len(more[0].output_ids) <= 4
    )
    assert more[0].prompt_ids == PROMPTS[1] + stopped.output_ids


def test_a_refused_distributed_update_fails_fast_with_the_servers_message(attach):
    engine = attach(
        weight_sync="distributed",
        bracket_weight_update=False,  # no /begin_weight_update: SGLang 0.5.23 refuses the bucket
        fallback_to_disk=False,
        weight_sync_timeout_s=300.0,
    )
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as raised:
        engine.update_weights(hf_weights(seed=0), version=6)
    elapsed = time.monotonic() - started
    message = str(raised.value)
    print(f"live: refused update failed after {elapsed:.1f}s: {message[:300]}")
    assert elapsed < FAIL_FAST_BOUND_S, f"{elapsed:.0f}s: {message}"
    assert "HTTP 400" in message and "must run between begin_weight_update() and end_weight_update()" in message
