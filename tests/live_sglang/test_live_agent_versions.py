"""Three-turn trajectories whose turns ran on two weight versions, against a real SGLang server WITH its prefix
(radix) cache (issue 61): under ``pause_mode=in_place`` the update keeps the cache, so every position's row is
the one SGLang recorded when its KV was computed -- the first turn's under the first weights, the later
turns' under the new weights over that kept KV -- and the trainer's forward that keeps the KV across the
weight change routes them so; under ``retract`` the update flushes it and the next turn is refused naming
``pause_mode=in_place``.

The session's server runs with ``--disable-radix-cache`` (the tier compares outputs across updates exactly), so
this module launches its own server (module scope: one start, 1-2.5 minutes on the 2 loaded cores) and shuts it
down at the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from support.live_server import CPU_SERVER_ARGS, live_config
from support.tiny_checkpoint import write_tiny_checkpoint
from test_live_engine import PROMPTS, TINY, hf_weights

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.agents.batcher import TurnBatcher
from gspo_megatron.rollout.agents.conversation import Conversation, RoutingSpliceError
from gspo_megatron.rollout.sglang.engine import SGLangEngine

# greedy: the same trajectories every run (the CPU server cannot seed sampling), so the exact comparison with the
# trainer-side forward below is reproducible
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=5, return_routed_experts=True)
INSERTED = [[30, 31, 32], [33]]  # a tool's answer after turns 0 and 1


@pytest.fixture(scope="module")
def cached_server(tiny_checkpoint, tmp_path_factory) -> Iterator[SGLangEngine]:
    """A server of the tiny checkpoint with its prefix cache, driven by an engine that pauses in place."""
    work = tmp_path_factory.mktemp("cached_server")
    started = time.monotonic()
    engine = SGLangEngine(
        live_config(
            mode="launch",
            model_path=str(tiny_checkpoint),
            log_dir=str(work / "logs"),
            disk_sync_dir=str(work / "disk_sync"),
            weight_sync_group_name="live_cached_in_place",
            extra_args=[arg for arg in CPU_SERVER_ARGS if arg != "--disable-radix-cache"],
            pause_mode="in_place",
        )
    )
    print(f"\nlive: SGLang server with a prefix cache {engine.server_urls[0]} up in {time.monotonic() - started:.0f}s")
    try:
        yield engine
    finally:
        engine.shutdown()


def attached(server: SGLangEngine, tiny_checkpoint, tmp_path, pause_mode: str) -> SGLangEngine:
    return SGLangEngine(
        live_config(
            mode="attach",
            urls=server.server_urls,
            model_path=str(tiny_checkpoint),
            disk_sync_dir=str(tmp_path / "disk_sync"),
            weight_sync_group_name=f"live_cached_{pause_mode}",
            pause_mode=pause_mode,
        )
    )


def three_turn_trajectories(
    engine: SGLangEngine, update: Callable[[list[Conversation]], None]
) -> tuple[list[Conversation], list[object]]:
    """One trajectory per prompt, all in flight over the engine's batches: turn, tool answer, turn, tool answer,
    turn; once every first turn has ended (no turn in flight), ``update(conversations)`` changes the weights.
    Returns the conversations and each one's outcome (None, or the exception that ended it)."""
    batcher = TurnBatcher(engine)
    conversations = [Conversation(list(prompt), batcher.generate, seed=index) for index, prompt in enumerate(PROMPTS)]
    first_turns_done = asyncio.Barrier(len(PROMPTS))
    updated = asyncio.Barrier(len(PROMPTS))

    def trajectory(conversation: Conversation):
        async def run() -> None:
            for turn in range(3):
                await conversation.generate(PARAMS)
                if turn == 0:
                    if await first_turns_done.wait() == 0:
                        update(conversations)
                    await updated.wait()
                if turn < 2:
                    conversation.insert(INSERTED[turn])

        return run

    outcomes = asyncio.run(batcher.run([trajectory(c) for c in conversations]))
    return conversations, outcomes


def routing_keeping_the_kv(first_weights, later_weights, ids: list[int], fed_first: int) -> torch.Tensor:
    """The trainer's forward of a trajectory whose KV is kept across the weight change: positions
    0..fed_first-1 under the checkpoint ``first_weights``, the rest under ``later_weights`` attending to that KV
    (transformers' Qwen3-MoE, fp32). Sorted top-k experts [len(ids), layers, top_k]."""
    from transformers import Qwen3MoeForCausalLM

    first_model, later_model = (
        Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for path in (first_weights, later_weights)
    )
    with torch.no_grad():
        first = first_model(torch.tensor([ids[:fed_first]]), use_cache=True, output_router_logits=True)
        later = later_model(torch.tensor([ids[fed_first:]]), cache=first.cache, output_router_logits=True)
    experts = [
        torch.stack([logits.topk(TINY.top_k, dim=-1).indices for logits in out.router_logits], dim=1)
        for out in (first, later)
    ]
    return torch.cat(experts).sort(-1).values


def test_in_place_turns_across_a_weight_update_keep_every_row_of_the_kv_it_computed(
    cached_server, tiny_checkpoint, tmp_path
):
    started = time.monotonic()
    fed_by_first_turn: list[int] = []

    def update(conversations: list[Conversation]) -> None:
        fed_by_first_turn.extend(c.fed for c in conversations)  # the positions the first weights computed
        cached_server.update_weights(hf_weights(seed=1), version=91)

    conversations, outcomes = three_turn_trajectories(cached_server, update)
    try:
        assert outcomes == [None] * len(PROMPTS)
        # the first turns' positions computed afresh under the new weights (a retract pause flushes the cache)
        with attached(cached_server, tiny_checkpoint, tmp_path, "retract") as flushing:
            flushing.update_weights(hf_weights(seed=1), version=92)
        one_token = SamplingParams(max_new_tokens=1, return_routed_experts=True)
        fresh = [cached_server.generate([c.ids[:-1]], one_token)[0][0].routed_experts for c in conversations]
    finally:
        cached_server.update_weights(hf_weights(seed=0), version=93)
    seed_one = write_tiny_checkpoint(tmp_path / "tiny_hf_seed1", seed=1)  # hf_weights(seed=1) as a checkpoint
    same, total, overwritten_would_show = 0, 0, 0
    for conversation, fresh_rows, fed_first in zip(conversations, fresh, fed_by_first_turn, strict=True):
        sample = conversation.sample()
        first, second, third = sample.turns
        assert (second.weight_version, third.weight_version) == (91, 91) and first.weight_version != 91
        held = sample.routed_experts
        assert held.shape == (len(conversation.ids) - 1, TINY.num_layers, TINY.top_k)
        # every later call was served the earlier positions' recorded rows (checked by the splice itself):
        # nothing was computed again, under any weights
        assert conversation.rerouted_positions == 0
        reference = routing_keeping_the_kv(tiny_checkpoint, seed_one, conversation.ids[:-1], fed_first)
        agree = (held.sort(-1).values == reference).all(dim=-1)
        same, total = same + int(agree.sum()), total + agree.numel()
        overwritten_would_show += int(
            not torch.equal(fresh_rows[:fed_first].sort(-1).values, held[:fed_first].sort(-1).values)
        )
    # zero engine-vs-trainer routing difference: every row is the one of the forward that computed its KV, under
    # the weights live then (the fp32 checkpoint; a near-tie the server's kernels flip would show here)
    assert same == total
    # the new weights route every first turn's positions otherwise: rows taken from a later call that computed
    # them again (verl #6054's overwrite) would show here
    assert overwritten_would_show == len(PROMPTS)
    print(
        f"\nlive: in_place trajectories and checks in {time.monotonic() - started:.0f}s; rows agreeing with "
        f"the kept-KV forward {same}/{total}"
    )


def test_retract_turns_across_a_weight_update_are_refused_naming_in_place(cached_server, tiny_checkpoint, tmp_path):
    with attached(cached_server, tiny_checkpoint, tmp_path, "retract") as engine:
        try:
            conversations, outcomes = three_turn_trajectories(
                engine, lambda _: engine.update_weights(hf_weights(seed=2), version=94)
            )
        finally:
            engine.update_weights(hf_weights(seed=0), version=95)
    for conversation, outcome in zip(conversations, outcomes, strict=True):
        assert isinstance(outcome, RoutingSpliceError) and "pause_mode=in_place" in str(outcome)
        assert len(conversation.spans) == 1  # the trajectory ends at its last exact turn
