"""Routing Replay across turns and weight versions with an engine that feeds the whole context each turn
(SGLang): the rows of the earlier positions come back with every call and are checked against the held ones.

Over the SGLang double, which keeps routed experts per KV slot through its prefix cache as SGLang 0.5.23 does
(``gspo_megatron/testing/sglang_double.py``): with ``pause_mode=in_place`` a weight update keeps the cache,
the later calls are served the earlier positions' recorded rows and the trajectory is exact; with
``retract`` the update flushes it, the next call computes those positions again under the new weights, and
the turn is refused naming ``pause_mode=in_place``. The splice rule itself is checked on hand-built results."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gspo_megatron.contracts.samples import FinishReason, SamplingParams
from gspo_megatron.rollout.agents.conversation import Conversation, RoutingSpliceError
from gspo_megatron.rollout.engine import EngineSession, TurnRequest, TurnResult
from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine

LAYOUT = dict(enable_return_routed_experts=True, num_hidden_layers=2, num_experts_per_tok=2)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, return_routed_experts=True)
PROMPT = [11, 12, 13, 14, 15]
INSERTED = [[30, 31, 32], [33]]  # a tool's answer after turns 0 and 1


def sglang_engine(double, tmp_path, pause_mode: str) -> SGLangEngine:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return SGLangEngine(
        SGLangConfig(
            mode="attach",
            urls=[double.url],
            weight_sync="disk",
            model_path=str(model),
            disk_sync_dir=str(tmp_path / "sync"),
            pause_mode=pause_mode,
            request_timeout_s=10.0,
            health_poll_interval_s=0.01,
            **LAYOUT,
        )
    )


def three_turns(engine: SGLangEngine, results: list[TurnResult]) -> Conversation:
    """Turn, tool answer, turn, tool answer, turn; the weights change (version 2) after the first turn.
    ``results`` gets each call's answer as it arrives (kept when a turn is refused)."""

    async def turn(request: TurnRequest) -> TurnResult:
        return engine.generate_turns([request])[0]

    conversation = Conversation(PROMPT, turn, seed=5)

    async def run() -> None:
        for index in range(3):
            results.append(await conversation.generate(PARAMS))
            if index == 0:
                engine.update_weights([("w", torch.ones(2))], version=2)
            if index < 2:
                conversation.insert(INSERTED[index])

    asyncio.run(run())
    return conversation


def test_in_place_turns_across_a_weight_update_replay_the_rows_recorded_when_their_kv_was_computed(doubles, tmp_path):
    double = doubles(
        deterministic_inference=True, num_layers=2, top_k=2, num_experts=8, enable_return_routed_experts=True
    )
    results: list[TurnResult] = []
    with sglang_engine(double, tmp_path, "in_place") as engine:
        conversation = three_turns(engine, results)
        sample = conversation.sample()
        # the positions the first turn fed, computed afresh under the new weights (a flush first): other rows
        with sglang_engine(double, tmp_path, "retract") as flushing:
            flushing.update_weights([("w", torch.ones(2))], version=2)
        trajectory = sample.prompt_ids + sample.output_ids
        (fresh,) = engine.generate([trajectory[:-1]], SamplingParams(max_new_tokens=1, return_routed_experts=True))[0]
    assert "/flush_cache" in [path for path, _ in double.calls]  # the retract engine's, after the trajectory
    assert [r.weight_version for r in results] == [0, 2, 2]
    fed_first = results[0].session.fed
    held = sample.routed_experts
    assert held.shape[0] == len(trajectory) - 1  # one row per fed position
    assert torch.equal(held[:fed_first], results[0].routed_experts)  # the first turn's, kept
    for before, after in zip(results, results[1:], strict=False):
        # the server's rows of every earlier position are the held ones: its cache served their KV
        assert torch.equal(after.earlier_rows, held[: before.session.fed])
    assert conversation.rerouted_positions == 0
    # the new weights route the first turn's positions otherwise: rows from a recomputation would show
    assert not torch.equal(fresh.routed_experts[:fed_first], held[:fed_first])


def test_retract_turns_across_a_weight_update_are_refused_naming_in_place(doubles, tmp_path):
    double = doubles(
        deterministic_inference=True, num_layers=2, top_k=2, num_experts=8, enable_return_routed_experts=True
    )
    results: list[TurnResult] = []
    with sglang_engine(double, tmp_path, "retract") as engine, pytest.raises(RoutingSpliceError, match="in_place"):
        three_turns(engine, results)
    assert "/flush_cache" in [path for path, _ in double.calls]
    (first,) = results  # the refused turn was not spliced: the trajectory ends at its last exact turn


def test_a_turn_on_unchanged_weights_over_a_cache_without_the_trajectory_is_exact(doubles, tmp_path):
    # no prefix cache at all (--disable-radix-cache): every turn computes the whole context again, under
    # the same weights, to the same rows
    double = doubles(
        deterministic_inference=True, radix_cache=False, num_layers=2, top_k=2, enable_return_routed_experts=True
    )

    async def turn(request: TurnRequest) -> TurnResult:
        return engine.generate_turns([request])[0]

    with sglang_engine(double, tmp_path, "in_place") as engine:
        conversation = Conversation(PROMPT, turn, seed=5)

        async def run() -> None:
            await conversation.generate(PARAMS)
            conversation.insert(INSERTED[0])
            await conversation.generate(PARAMS)

        asyncio.run(run())
    assert conversation.rerouted_positions == 0 and len(conversation.spans) == 2


def rows(*experts: int) -> torch.Tensor:
    """One position per value, one layer, top-1."""
    return torch.tensor(experts, dtype=torch.int32).view(-1, 1, 1)


def scripted_turns(answers: list[TurnResult]):
    async def turn(request: TurnRequest) -> TurnResult:
        return answers.pop(0)

    return turn


def result(new_rows: torch.Tensor, fed: int, version: int, earlier: torch.Tensor | None) -> TurnResult:
    return TurnResult([9], torch.zeros(1), FinishReason.STOP, version, new_rows, EngineSession(fed), earlier)


@pytest.mark.parametrize(
    ("earlier", "version", "refused", "rerouted"),
    [
        (rows(1, 2, 3), 2, False, 0),  # served from the cache: the rows held
        (rows(1, 4, 3), 1, False, 1),  # computed again under the same weights, one routed otherwise: counted
        (rows(1, 4, 3), 2, True, 0),  # computed again under the new weights, routed otherwise: refused
        (rows(1, 2, 3), 2, False, 0),  # computed again under the new weights, routed the same: one routing fits
    ],
)
def test_the_splice_checks_the_engines_rows_of_held_positions_by_hand(earlier, version, refused, rerouted):
    # prompt a b c; turn 0 (version 1) feeds a b c and generates o0; turn 1 feeds o0 (its prefill) and
    # generates o1, which is never fed
    answers = [result(rows(1, 2, 3), 3, 1, None), result(rows(5), 4, version, earlier)]
    conversation = Conversation([1, 2, 3], scripted_turns(answers), seed=0)

    async def run() -> None:
        await conversation.generate(PARAMS)
        await conversation.generate(PARAMS)

    if refused:
        with pytest.raises(RoutingSpliceError, match="under its new weights"):
            asyncio.run(run())
        assert len(conversation.spans) == 1 and torch.equal(torch.cat(conversation.routing), rows(1, 2, 3))
        return
    asyncio.run(run())
    assert torch.equal(torch.cat(conversation.routing), rows(1, 2, 3, 5))  # the held rows stay
    assert conversation.rerouted_positions == rerouted


def test_the_engines_rows_of_held_positions_must_cover_them():
    answers = [result(rows(1, 2, 3), 3, 1, None), result(rows(5), 4, 1, rows(1, 2))]
    conversation = Conversation([1, 2, 3], scripted_turns(answers), seed=0)

    async def run() -> None:
        await conversation.generate(PARAMS)
        await conversation.generate(PARAMS)

    with pytest.raises(RoutingSpliceError, match="positions already held"):
        asyncio.run(run())
