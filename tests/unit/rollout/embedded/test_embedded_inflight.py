"""EmbeddedEngine.request_update: a weight version lands between two decode steps of a generation running in
another thread, under ``in_place`` (the KV cache kept) or ``retract`` (the running rows' KV computed again).

The generation pauses inside forward ``AFTER`` (a forward hook that waits for the test's request: events, no
sleeps), so the update lands at the boundary before forward ``AFTER + 1``: the first ``AFTER + 1`` tokens carry
the old version, the rest the new. References are computed apart from the engine, by the same models'
forwards, teacher-forced: under ``in_place`` the old weights' forward over the positions fed before the update
keeps its KV cache and the new weights' forward continues over it; under ``retract`` a full forward of each
version over the whole sequence."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from test_embedded_engine import engine_from, peaked_source_model, tiny_config
from transformers.cache_utils import DynamicCache

from gspo_megatron.contracts.samples import TOKEN_VERSIONS, FinishReason, Sample, SamplingParams
from gspo_megatron.rollout.embedded.inflight import RETRACT_REROUTED
from gspo_megatron.rollout.embedded.kv_cache import cache_argument
from gspo_megatron.rollout.engine import TurnRequest

WAIT_S = 60.0  # bound on every wait for the other thread (never reached when the test passes)
AFTER = 2  # the update lands after forward 2 (0 is the prefill): 3 tokens of version 1, then version 2
OLD, NEW = 1, 2
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=7, seed=11, return_routed_experts=True)


class PauseAfterForward:
    """A forward hook on the engine model's ``lm_head`` (the last module of every forward, transformers' and the
    lean one): inside forward ``step`` it sets ``reached`` and waits for
    ``release`` (bounded), so whatever the test does meanwhile happens while that forward runs."""

    def __init__(self, model, step: int):
        self.step, self.count = step, 0
        self.reached, self.release = threading.Event(), threading.Event()
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if self.count == self.step:
            self.reached.set()
            if not self.release.wait(WAIT_S):
                raise TimeoutError(f"the test did not release forward {self.step} within {WAIT_S} s")
        self.count += 1

    def remove(self):
        self._handle.remove()


class Worker:
    """``call()`` in its own thread; ``result()`` joins it (bounded) and re-raises what it raised."""

    def __init__(self, call):
        self._out: dict = {}
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call):
        try:
            self._out["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            self._out["error"] = error

    def result(self):
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), f"the generation did not end within {WAIT_S} s"
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


def generate_with_update(engine, weights: dict, mode: str, params=PARAMS) -> list[Sample]:
    """``engine.generate(PROMPTS)`` in a worker thread; version ``NEW`` requested from this thread while forward
    ``AFTER`` runs. Each prompt's first sample (``generate_groups_with_update``: all of them)."""
    return [group[0] for group in generate_groups_with_update(engine, weights, mode, params)]


def generate_groups_with_update(engine, weights: dict, mode: str, params=PARAMS) -> list[list[Sample]]:
    pause = PauseAfterForward(engine.model.lm_head, AFTER)
    try:
        worker = Worker(lambda: engine.generate(PROMPTS, params))
        assert pause.reached.wait(WAIT_S)
        ticket = engine.request_update(weights.items(), NEW, mode)
        assert not ticket.done and engine.weight_version == OLD  # it waits for the step boundary
        pause.release.set()
        ticket.wait(timeout_s=WAIT_S)
        groups = worker.result()
    finally:
        pause.release.set()
        pause.remove()
    assert engine.weight_version == NEW
    return groups


def token_versions(sample: Sample) -> list[int]:
    return sample.extra.get(TOKEN_VERSIONS, [sample.weight_version] * len(sample.output_ids))


def forward(model, ids: list[int], cache=None):
    """(log-softmax of every position's next token [len(ids), V], top-k experts of every position, sorted
    [len(ids), layers, k]); ``cache`` holds the positions before ``ids`` and is extended."""
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            output_router_logits=True,
            use_cache=cache is not None,
            **{cache_argument(type(model)): cache},
        )
    k = model.config.num_experts_per_tok
    experts = torch.stack([torch.topk(logits, k, dim=-1).indices for logits in out.router_logits], dim=1)
    return torch.log_softmax(out.logits[0].float(), -1), experts.sort(-1).values.to(torch.int32)


def chosen(log_softmax: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return log_softmax.gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture(scope="module")
def models():
    return peaked_source_model(tiny_config(), seed=1), peaked_source_model(tiny_config(), seed=2)


def test_in_place_keeps_the_kv_and_each_token_scores_under_its_own_version(models):
    old, new = models
    engine = engine_from(old)  # version 1
    samples = generate_with_update(engine, new.state_dict(), "in_place")
    switch = AFTER + 1  # tokens sampled before the update
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        assert sample.finish_reason == FinishReason.LENGTH
        assert token_versions(sample) == [OLD] * switch + [NEW] * (len(sample.output_ids) - switch)
        assert sample.weight_version == OLD  # the oldest, as a retracted SGLang sample records it
        # reference: the old weights over the positions fed before the update (their KV kept), then the new
        # weights feeding the rest over that KV, one forward each -- teacher-forced on the engine's tokens
        cache = DynamicCache(config=old.config)
        before = prompt + sample.output_ids[: switch - 1]
        old_log_softmax, old_rows = forward(old, before, cache)
        new_log_softmax, new_rows = forward(new, sample.output_ids[switch - 1 : -1], cache)
        expected = torch.cat(
            [
                chosen(old_log_softmax[len(prompt) - 1 :], sample.output_ids[:switch]),
                chosen(new_log_softmax, sample.output_ids[switch:]),
            ]
        )
        torch.testing.assert_close(sample.output_log_probs, expected, atol=1e-5, rtol=0)
        # the kept KV matters: a full forward of the new weights (what retract computes) scores them otherwise
        retracted = chosen(forward(new, prompt + sample.output_ids[:-1])[0][len(prompt) - 1 :], sample.output_ids)
        assert (retracted[switch:] - expected[switch:]).abs().max() > 1e-3
        # R3: every position keeps the row of the forward that computed its KV: the old weights' before the
        # update, the new weights' from the token fed first after it on
        assert torch.equal(sample.routed_experts.sort(-1).values, torch.cat([old_rows, new_rows]))
        # and they are not what a full forward of the new weights would route (the test could tell)
        assert not torch.equal(old_rows, forward(new, before)[1])


@pytest.mark.parametrize("use_cache", [True, False])
def test_retract_scores_the_tokens_after_the_update_by_a_full_forward_of_the_new_weights(models, use_cache):
    old, new = models
    engine = engine_from(old, use_cache=use_cache)
    params = SamplingParams(**{**PARAMS.__dict__, "return_routed_experts": False})
    samples = generate_with_update(engine, new.state_dict(), "retract", params)
    switch = AFTER + 1
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        assert token_versions(sample) == [OLD] * switch + [NEW] * (len(sample.output_ids) - switch)
        whole = prompt + sample.output_ids[:-1]
        old_full = chosen(forward(old, whole)[0][len(prompt) - 1 :], sample.output_ids)
        new_full = chosen(forward(new, whole)[0][len(prompt) - 1 :], sample.output_ids)
        torch.testing.assert_close(sample.output_log_probs[:switch], old_full[:switch], atol=1e-5, rtol=0)
        torch.testing.assert_close(sample.output_log_probs[switch:], new_full[switch:], atol=1e-5, rtol=0)
        assert (new_full[switch:] - old_full[switch:]).abs().max() > 1e-2  # the versions differ measurably


def test_retract_recomputes_each_row_of_a_repeated_prompt_from_its_own_tokens(models):
    """The prefill feeds a repeated prompt once (``_prefill_once_per_prompt``); a retract's recompute feeds every
    running row's own prompt and tokens, which differ between the samples of one prompt."""
    old, new = models
    engine = engine_from(old)
    params = SamplingParams(**{**PARAMS.__dict__, "return_routed_experts": False, "n": 3})
    groups = generate_groups_with_update(engine, new.state_dict(), "retract", params)
    switch = AFTER + 1
    assert any(len({tuple(s.output_ids[:switch]) for s in group}) > 1 for group in groups)  # the samples differ
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for sample in group:
            whole = prompt + sample.output_ids[:-1]
            new_full = chosen(forward(new, whole)[0][len(prompt) - 1 :], sample.output_ids)
            torch.testing.assert_close(sample.output_log_probs[switch:], new_full[switch:], atol=1e-5, rtol=0)


def test_retract_ends_a_row_whose_routing_the_new_weights_change_at_its_last_exact_token(models):
    old, new = models
    engine = engine_from(old)
    samples = generate_with_update(engine, new.state_dict(), "retract")
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        # one row per position cannot replay both routings: the row ends with what the old weights sampled
        assert sample.finish_reason == FinishReason.ABORT
        assert len(sample.output_ids) == AFTER + 1 and token_versions(sample) == [OLD] * (AFTER + 1)
        assert sample.extra[RETRACT_REROUTED] > 0
        whole = prompt + sample.output_ids[:-1]
        log_softmax, rows = forward(old, whole)
        assert torch.equal(sample.routed_experts.sort(-1).values, rows)  # the old weights' rows, kept
        torch.testing.assert_close(
            sample.output_log_probs, chosen(log_softmax[len(prompt) - 1 :], sample.output_ids), atol=1e-5, rtol=0
        )


def test_retract_goes_on_where_the_new_weights_route_alike(models):
    old, _ = models
    new = copy.deepcopy(old)  # a new output head only: every layer's routing stays as it was
    with torch.no_grad():
        new.lm_head.weight.normal_(0.0, 0.35, generator=torch.Generator().manual_seed(5))
    engine = engine_from(old)
    samples = generate_with_update(engine, {"lm_head.weight": new.lm_head.weight}, "retract")
    switch = AFTER + 1
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        assert sample.finish_reason == FinishReason.LENGTH and RETRACT_REROUTED not in sample.extra
        assert token_versions(sample) == [OLD] * switch + [NEW] * (len(sample.output_ids) - switch)
        whole = prompt + sample.output_ids[:-1]
        log_softmax, rows = forward(new, whole)
        assert torch.equal(sample.routed_experts.sort(-1).values, rows)
        torch.testing.assert_close(
            sample.output_log_probs[switch:],
            chosen(log_softmax[len(prompt) - 1 :], sample.output_ids)[switch:],
            atol=1e-5,
            rtol=0,
        )


def test_an_idle_engine_applies_at_once_and_bad_requests_are_refused(models):
    old, new = models
    engine = engine_from(old)
    with pytest.raises(ValueError, match="'sideways' is unknown; valid: in_place, retract"):
        engine.request_update(new.state_dict().items(), NEW, "sideways")
    ticket = engine.request_update(new.state_dict().items(), NEW, "in_place")
    assert ticket.done and engine.weight_version == NEW
    ticket.wait(timeout_s=0)
    no_cache = engine_from(old, use_cache=False)
    with pytest.raises(ValueError, match="use mode retract"):
        no_cache.request_update(new.state_dict().items(), NEW, "in_place")


def test_a_wait_that_times_out_withdraws_the_update_and_a_second_request_is_refused(models):
    old, new = models
    engine = engine_from(old)
    pause = PauseAfterForward(engine.model.lm_head, AFTER)
    try:
        worker = Worker(lambda: engine.generate(PROMPTS, PARAMS))
        assert pause.reached.wait(WAIT_S)
        ticket = engine.request_update(new.state_dict().items(), NEW, "in_place")
        with pytest.raises(RuntimeError, match="version 2 is still pending"):
            engine.request_update(new.state_dict().items(), 3, "in_place")
        # the generation is held inside a forward, so no step boundary can come before the wait ends
        with pytest.raises(TimeoutError, match="withdrawn"):
            ticket.wait(timeout_s=0.01)
        pause.release.set()
        samples = [group[0] for group in worker.result()]
    finally:
        pause.release.set()
        pause.remove()
    assert engine.weight_version == OLD
    assert all(s.weight_version == OLD and TOKEN_VERSIONS not in s.extra for s in samples)


def test_a_turn_takes_no_update_inside_it_lands_as_the_call_ends(models):
    old, new = models
    engine = engine_from(old)
    pause = PauseAfterForward(engine.model.lm_head, AFTER)
    try:
        worker = Worker(lambda: engine.generate_turns([TurnRequest(p, PARAMS) for p in PROMPTS]))
        assert pause.reached.wait(WAIT_S)
        ticket = engine.request_update(new.state_dict().items(), NEW, "in_place")
        pause.release.set()
        ticket.wait(timeout_s=WAIT_S)  # applied when generate_turns returned
        results = worker.result()
    finally:
        pause.release.set()
        pause.remove()
    assert engine.weight_version == NEW
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.weight_version == OLD and len(result.output_ids) == PARAMS.max_new_tokens
        torch.testing.assert_close(
            result.output_log_probs,
            chosen(forward(old, prompt + result.output_ids[:-1])[0][len(prompt) - 1 :], result.output_ids),
            atol=1e-5,
            rtol=0,
        )
