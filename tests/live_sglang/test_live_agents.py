"""Multi-turn trajectories against the real SGLang server (issue 61): each turn a request continuing the
trajectory's ids on its own server, the routing rows spliced per turn and never overwritten -- also when
the weights change between turns -- and the prefix cache's rows of earlier positions, when the server
still holds them, the ones recorded when their KV was computed."""

from __future__ import annotations

import torch
from test_live_engine import PROMPTS, TINY, hf_weights, reference_forward

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.engine import TurnRequest

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=5, return_routed_experts=True)
INSERTED = [[30, 31, 32], [33], [34, 35]]  # a tool's answer, as token ids


def three_turns(engine, between=None):
    """Turn, inserted ids, turn, inserted ids, turn, for each prompt; ``between`` runs after the first turn.
    Returns each trajectory's ids, its rows as spliced, and each call's rows."""
    ids = [list(p) for p in PROMPTS]
    rows: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    sessions = [None] * len(PROMPTS)
    calls = []
    for turn in range(3):
        requests = [TurnRequest(i, PARAMS, s) for i, s in zip(ids, sessions, strict=True)]
        results = engine.generate_turns(requests)
        calls.append(results)
        for index, result in enumerate(results):
            rows[index].append(result.routed_experts)
            sessions[index] = result.session
            ids[index] = ids[index] + result.output_ids + (INSERTED[index] if turn < 2 else [])
        if turn == 0 and between is not None:
            between()
    return ids, [torch.cat(r) for r in rows], calls


def test_three_turn_trajectories_keep_one_row_per_fed_position_and_the_servers_routing(live_engine, tiny_checkpoint):
    ids, rows, calls = three_turns(live_engine)
    same, total = 0, 0
    for trajectory, held, prompt in zip(ids, rows, PROMPTS, strict=True):
        # the last turn's final token is never fed: one row for every other position, none twice
        assert held.shape == (len(trajectory) - 1, TINY.num_layers, TINY.top_k)
        assert int(held.min()) >= 0 and int(held.max()) < TINY.num_experts
        _, experts = reference_forward(tiny_checkpoint, trajectory[:-1])
        agree = (held.sort(dim=-1).values == experts.sort(dim=-1).values).all(dim=-1)
        same, total = same + int(agree.sum()), total + agree.numel()
        assert calls[0][PROMPTS.index(prompt)].session.state == calls[2][PROMPTS.index(prompt)].session.state
    assert same >= 0.9 * total  # the server's half precision flips a few near-ties, as single-turn


def test_the_prefix_caches_rows_of_earlier_positions_are_those_recorded_when_computed(live_engine):
    # a turn's request sends the whole context; the server's answer covers every position. Where its prefix
    # cache served the earlier positions, their rows are the ones the earlier call returned
    ids, rows, calls = three_turns(live_engine)
    for trajectory, held in zip(ids, rows, strict=True):
        (again,) = live_engine.generate(
            [trajectory[:-1]], SamplingParams(max_new_tokens=1, return_routed_experts=True)
        )[0]
        fed = len(trajectory) - 2  # the positions the trajectory's own turns fed before the last token
        assert torch.equal(again.routed_experts[:fed], held[:fed])


def test_turns_across_a_weight_update_keep_the_first_turns_rows(live_engine):
    # after the first turn the server loads other weights (and drops its cache): the later turns' calls route
    # the earlier positions again, under the new weights; the trajectory keeps the first turn's rows
    def other_weights():
        live_engine.update_weights(hf_weights(seed=1), version=91)

    try:
        ids, rows, calls = three_turns(live_engine, between=other_weights)
        one_token = SamplingParams(max_new_tokens=1, return_routed_experts=True)
        under_new = [live_engine.generate([t[:-1]], one_token)[0][0].routed_experts for t in ids]
    finally:
        live_engine.update_weights(hf_weights(seed=0), version=92)  # the checkpoint's weights, for the other tests
    differs = 0
    for index, held in enumerate(rows):
        first = calls[0][index]
        assert first.weight_version != 91 and calls[1][index].weight_version == 91
        fed = first.session.fed
        assert torch.equal(held[:fed], first.routed_experts)  # the first turn's, kept
        differs += int(not torch.equal(under_new[index][:fed].sort(-1).values, held[:fed].sort(-1).values))
    assert differs  # the new weights route those positions otherwise: an overwrite would show
