"""Over-sampling with an agent (issue 61): a trajectory cut at a step's end is carried whole and continued on
the next step's weights (``rollout/agents/carried.py``, ``partial.py:draw_trajectories``).

The references are apart from the code under test: an uninterrupted trajectory over which the weights change
between the same two turns (the embedded engine keeps its KV cache), the transformers model's own forward
under the first weights, and the carried record itself."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

from gspo_megatron.contracts.samples import TOKEN_VERSIONS, SamplingParams
from gspo_megatron.core.tool_call_formats import ToolCall
from gspo_megatron.rollout.agents.agent import AgentContext
from gspo_megatron.rollout.agents.carried import CARRIED_TRAJECTORY, CarriedTrajectory
from gspo_megatron.rollout.agents.partial import Group, PartialRollouts, _unfinished_sample, finished
from gspo_megatron.rollout.agents.tools.calculator import Calculator
from gspo_megatron.rollout.agents.tools.runner import ToolRunner
from gspo_megatron.rollout.agents.trajectories import AGENT_STATS, TrajectoryRunner, TrajectoryStart, trajectory_seed
from gspo_megatron.rollout.config import AgentConfig, PartialRollout
from gspo_megatron.rollout.data.records import PromptRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trajectories import TEMPLATE, TOKENIZER, engine, full_forward, model  # the agent tests' own

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=11, return_routed_experts=True)
BUDGET = ("rollout.agent.max_tokens", 80)


def record(prompt: str, turns: int) -> PromptRecord:
    return PromptRecord(prompt, "7", {"turns": turns}, tuple(TOKENIZER.encode(prompt)))


def turns_of_the_record(after_first_turn=None):
    """``record.metadata["turns"]`` turns, each but the last followed by a calculator call (a tool run again
    when the trajectory is continued) and its answer inserted; ``after_first_turn`` runs once, after turn 0."""

    async def agent(ctx: AgentContext) -> None:
        for turn in range(int(ctx.record.metadata["turns"]) - 1):
            await ctx.conversation.generate(ctx.turn_params())
            if turn == 0 and after_first_turn is not None:
                after_first_turn()
            answer = await ctx.call_tool(ToolCall("calculator", {"expression": "3+4"}))
            ctx.conversation.insert(TEMPLATE.tool_answers([("calculator", answer)]))
        await ctx.conversation.generate(ctx.turn_params())

    return agent


def runner(eng, agent) -> TrajectoryRunner:
    config = AgentConfig(name="tool_calling", max_turns=4, max_tokens=BUDGET[1])
    return TrajectoryRunner(eng, agent, TEMPLATE, lambda _: ToolRunner([Calculator()]), config, TOKENIZER.decode)


def cut_after(eng, long: PromptRecord, turns: int = 1):
    """``long``'s two trajectories beside a group of ``turns`` turns, one group needed: that group ends after
    ``turns`` engine calls, and ``long``'s trajectories are cut after as many turns (they come first in each
    call, so they are in their tool when the cut falls, and end at their next turn)."""
    short = record("add 1 2:", turns)
    starts = [TrajectoryStart(r, trajectory_seed(PARAMS, i)) for i, r in enumerate([long, long, short, short])]
    outcomes = runner(eng, turns_of_the_record()).generate_until(starts, [0, 0, 1, 1], PARAMS, 1)
    carried, finished = outcomes[:2], outcomes[2:]
    assert all(isinstance(c, CarriedTrajectory) for c in carried) and all(f is not None for f in finished)
    return starts[:2], carried


def test_a_carried_trajectory_continues_on_new_weights_as_if_they_had_changed_between_its_turns():
    first_weights, second_weights = model(1), model(2)
    long = record("add 3 4:", 3)
    eng = engine(first_weights)
    starts, carried = cut_after(eng, long)
    assert [len(c.spans) for c in carried] == [1, 1]
    held = [torch.cat(c.routing).clone() for c in carried]
    eng.update_weights(second_weights.state_dict().items(), version=2)
    continued = runner(eng, turns_of_the_record()).generate_until(
        [TrajectoryStart(long, s.seed, c) for s, c in zip(starts, carried, strict=True)], [0, 0], PARAMS, 1
    )
    # the reference: one uninterrupted call, the weights changed after the first turn
    reference_engine = engine(first_weights)
    update = lambda: reference_engine.update_weights(second_weights.state_dict().items(), version=2)
    (reference,) = runner(reference_engine, turns_of_the_record(update)).generate([long], PARAMS)
    differs = 0
    for sample, expected, rows in zip(continued, reference, held, strict=True):
        assert sample.extra[AGENT_STATS]["error"] is None and len(sample.turns) == 3
        assert sample.output_ids == expected.output_ids
        torch.testing.assert_close(sample.output_log_probs, expected.output_log_probs, atol=1e-5, rtol=0)
        assert torch.equal(sample.routed_experts, expected.routed_experts)
        first = sample.turns[0]
        versions = sample.extra[TOKEN_VERSIONS]
        for turn in sample.turns:  # each token the version that sampled it (an inserted one: the turn before's)
            assert versions[turn.start : turn.end] == [turn.weight_version] * (turn.end - turn.start)
        assert [turn.weight_version for turn in sample.turns] == [1, 2, 2] and sample.weight_version == 1
        # the carried rows are kept as recorded (R3 replays each token's own), and they are the first weights'
        assert torch.equal(sample.routed_experts[: rows.shape[0]], rows)
        _, under_first = full_forward(first_weights, sample.prompt_ids + sample.output_ids[: first.end])
        assert torch.equal(rows.sort(-1).values, under_first)
        _, under_second = full_forward(second_weights, sample.prompt_ids + sample.output_ids)
        differs += int(not torch.equal(under_second[: rows.shape[0]], under_first))
    assert differs  # the second weights route those positions otherwise: an overwrite would be caught


def test_a_continued_agent_that_asks_after_other_tokens_ends_at_its_recorded_turns():
    """A recorded turn is answered only after the tokens it was sampled after; otherwise the trajectory is
    what was recorded, with the error counted."""
    long = record("add 3 4:", 4)
    eng = engine(model(1))
    starts, carried = cut_after(eng, long, turns=2)
    assert [len(c.spans) for c in carried] == [2, 2]

    async def another_answer(ctx: AgentContext) -> None:  # the tool answers otherwise the second time
        await ctx.conversation.generate(ctx.turn_params())
        ctx.conversation.insert(TEMPLATE.tool_answers([("calculator", Calculator().call({"expression": "5+5"}))]))
        await ctx.conversation.generate(ctx.turn_params())

    continued = runner(eng, another_answer).generate_until(
        [TrajectoryStart(long, s.seed, c) for s, c in zip(starts, carried, strict=True)], [0, 0], PARAMS, 1
    )
    for sample, kept in zip(continued, carried, strict=True):
        assert "ReplayDivergedError" in sample.extra[AGENT_STATS]["error"]
        assert len(sample.turns) == 2 and sample.output_ids == kept.output_ids[: kept.generated_end]


class _Prompts:
    """The records a task would draw, in the order given."""

    def __init__(self, *batches: list[PromptRecord]):
        self.batches = list(batches)

    def __call__(self, count: int) -> list[PromptRecord]:
        batch = self.batches.pop(0)
        assert len(batch) == count
        return batch


def _saved_and_loaded(partial: PartialRollouts, eng) -> PartialRollouts:
    """``partial``'s carried groups through a checkpoint's file (``weights_only``: plain data and tensors)."""
    buffer = io.BytesIO()
    torch.save(partial.state_dict(), buffer)
    buffer.seek(0)
    loaded = PartialRollouts(2.0, PartialRollout("continue"), 2, eng, BUDGET)
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    return loaded


def test_carried_trajectories_go_into_the_next_step_and_through_a_checkpoint_exactly():
    first_weights, second_weights = model(1), model(2)
    eng = engine(first_weights)
    partial = PartialRollouts(2.0, PartialRollout("continue"), 2, eng, BUDGET)
    step_one = _Prompts([record("add 3 4:", 3), record("add 1 2:", 1)])
    drawn = partial.draw_trajectories(1, step_one, runner(eng, turns_of_the_record()).generate_until, PARAMS, 1)
    assert [group.record.prompt for group in drawn.groups] == ["add 1 2:"]
    (carried_group,) = partial.carried
    kept = [s.extra[CARRIED_TRAJECTORY] for s in carried_group.samples]  # the group's samples are replaced next
    assert drawn.metrics["rollout/partial/aborted_samples"] == 2.0  # cut with turns, carried whole
    eng.update_weights(second_weights.state_dict().items(), version=2)
    # a resumed run: a new engine with the checkpoint's weights, the carried groups from the checkpoint's file
    resumed_engine = engine(first_weights)
    resumed_engine.update_weights(second_weights.state_dict().items(), version=2)
    resumed = _saved_and_loaded(partial, resumed_engine)
    results = []
    for parts, on in ((partial, eng), (resumed, resumed_engine)):
        step_two = _Prompts([record("add 5 6:", 4)])  # a longer fresh group: the carried one completes first
        results.append(
            parts.draw_trajectories(1, step_two, runner(on, turns_of_the_record()).generate_until, PARAMS, 2)
        )
    added = sum(len(s.output_ids) - c.generated_end for s, c in zip(results[0].groups[0].samples, kept, strict=True))
    (fresh,) = partial.carried  # the longer group, cut: carried out
    added += sum(len(s.output_ids) for s in fresh.samples)
    assert results[0].metrics["rollout/partial/generated_tokens"] == added  # the recorded turns are not counted
    for drawn_two in results:
        assert drawn_two.metrics["rollout/partial/groups_carried_in"] == 1.0
        assert [group.record.prompt for group in drawn_two.groups] == ["add 3 4:"]
        assert drawn_two.metrics["rollout/partial/stale_tokens_age_1"] > 0
    for sample, again, carried in zip(results[0].groups[0].samples, results[1].groups[0].samples, kept, strict=True):
        assert len(sample.turns) == 3 and sample.output_ids == again.output_ids
        assert torch.equal(sample.output_log_probs, again.output_log_probs)
        assert torch.equal(sample.routed_experts, again.routed_experts)  # the KV from the checkpoint: same rows
        rows = torch.cat(carried.routing)
        assert torch.equal(sample.routed_experts[: rows.shape[0]], rows)
        assert sample.extra[TOKEN_VERSIONS][: carried.generated_end] == [1] * carried.generated_end


def test_a_carried_group_keeps_its_ended_trajectories_provenance_through_a_checkpoint():
    """A carried group may hold ended trajectories beside cut ones: their inserted tokens, turns and counts
    go through the checkpoint (else a resumed run would train inserted tokens); one that failed before its
    first turn is ended (ABORT, no tokens), not a trajectory to start again."""
    eng = engine(model(1))
    long = record("add 3 4:", 3)
    _, (cut, _) = cut_after(eng, long)
    (ended, _) = runner(eng, turns_of_the_record()).generate([long], PARAMS)[0]

    async def fails_at_once(ctx: AgentContext) -> None:
        raise ConnectionResetError("the client's connection dropped")

    (failed, _) = runner(eng, fails_at_once).generate([long], PARAMS)[0]
    assert failed.finish_reason.value == "abort" and finished(failed) and finished(ended)
    partial = PartialRollouts(2.0, PartialRollout("continue"), 2, eng, BUDGET)
    partial.carried = [Group(long, [ended, failed]), Group(long, [_unfinished_sample(TrajectoryStart(long, 0), cut)])]
    loaded = _saved_and_loaded(partial, eng)
    (again, again_failed), (again_cut,) = (group.samples for group in loaded.carried)
    assert int(ended.inserted_mask.sum()) > 0 and torch.equal(again.inserted_mask, ended.inserted_mask)
    assert again.turns == ended.turns and again.extra[AGENT_STATS] == ended.extra[AGENT_STATS]
    assert finished(again) and finished(again_failed) and not finished(again_cut)
    assert again_failed.extra[AGENT_STATS]["error"] == failed.extra[AGENT_STATS]["error"]
    assert again_cut.extra[CARRIED_TRAJECTORY].output_ids == cut.output_ids
