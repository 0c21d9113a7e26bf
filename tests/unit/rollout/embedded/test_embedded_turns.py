"""EmbeddedEngine.generate_turns: a trajectory continues its own KV cache turn after turn, so each position
goes through one forward, and its routing row is that forward's -- under the weights live then.

References are computed apart from the engine: the same model's full forward over the whole context (with
``output_router_logits``: its top-k per position), teacher-forced."""

from __future__ import annotations

import torch
from test_embedded_engine import engine_from, peaked_source_model, tiny_config

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.engine import TurnRequest

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, return_routed_experts=True)
PROMPTS = [[5, 9, 17, 3], [40, 2], [11, 12, 13, 14, 15, 16]]
INSERTED = [[61, 62, 63], [70], [7, 8]]  # a tool's answer, as token ids


def full_forward_routing(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of each next token [len - 1], top-k experts of every position but the last [len - 1, L, k])."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    log_probs = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    k = model.config.num_experts_per_tok
    experts = torch.stack([torch.topk(logits, k, dim=-1).indices for logits in out.router_logits], dim=1)
    return log_probs, experts[:-1].sort(-1).values.to(torch.int32)


def two_turns(engine, second_weights=None):
    """Turn 1 on the engine's weights; the inserted tokens; turn 2 (after loading ``second_weights``)."""
    first = engine.generate_turns(
        [TurnRequest(p, SamplingParams(**{**PARAMS.__dict__, "seed": 100 + i})) for i, p in enumerate(PROMPTS)]
    )
    contexts = [p + r.output_ids + extra for p, r, extra in zip(PROMPTS, first, INSERTED, strict=True)]
    if second_weights is not None:
        engine.update_weights(second_weights.state_dict().items(), version=2)
    second = engine.generate_turns(
        [
            TurnRequest(ids, SamplingParams(**{**PARAMS.__dict__, "seed": 200 + i}), r.session)
            for i, (ids, r) in enumerate(zip(contexts, first, strict=True))
        ]
    )
    return first, contexts, second


def test_a_second_turn_feeds_only_what_its_session_lacks_and_scores_like_a_full_forward():
    source = peaked_source_model(tiny_config())
    engine = engine_from(source)
    first, contexts, second = two_turns(engine)
    for p, r1, ids, r2 in zip(PROMPTS, first, contexts, second, strict=True):
        assert r1.session.fed == len(p) + len(r1.output_ids) - 1
        assert r2.session.fed == len(ids) + len(r2.output_ids) - 1
        # rows of exactly the positions each call fed: turn 1 from 0, turn 2 from where turn 1 stopped
        assert r1.routed_experts.shape[0] == r1.session.fed
        assert r2.routed_experts.shape[0] == r2.session.fed - r1.session.fed
        whole = ids + r2.output_ids
        log_probs, experts = full_forward_routing(source, whole)
        # the engine's log-probs of turn 2's tokens equal a full forward's over the whole context
        torch.testing.assert_close(r2.output_log_probs, log_probs[len(ids) - 1 :], atol=1e-4, rtol=0)
        spliced = torch.cat([r1.routed_experts, r2.routed_experts]).sort(-1).values
        assert torch.equal(spliced, experts)  # one set of weights: one routing, however it was fed


def test_turns_on_two_weight_versions_keep_each_positions_routing_from_its_own_forward():
    source, other = peaked_source_model(tiny_config(), seed=1), peaked_source_model(tiny_config(), seed=2)
    engine = engine_from(source)
    first, contexts, second = two_turns(engine, second_weights=other)
    assert [r.weight_version for r in first] == [1] * 3 and [r.weight_version for r in second] == [2] * 3
    differs = 0
    for p, r1, ids, r2 in zip(PROMPTS, first, contexts, second, strict=True):
        before = len(p) + len(r1.output_ids) - 1  # positions turn 1 fed: under the first weights
        _, under_first = full_forward_routing(source, p + r1.output_ids)
        assert torch.equal(r1.routed_experts.sort(-1).values, under_first)
        # turn 2's positions ran under the second weights, attending to turn 1's cached (first-weight) KV:
        # a full forward under the second weights routes the earlier positions otherwise
        _, under_second = full_forward_routing(other, ids + r2.output_ids)
        differs += int(not torch.equal(under_second[:before], under_first))
        # and turn 2's log-probs are not a full forward's under either weights alone -- they read turn 1's KV
    assert differs > 0  # the test can tell the two weights' routing apart (so overwriting would be seen)
