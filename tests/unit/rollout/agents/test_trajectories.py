"""Multi-turn trajectories over the embedded engine: token-in-token-out, provenance, routing spliced per turn
(never overwritten, across a weight update), tools bounded, the built-in tool-calling agent.

The references are computed apart from the code under test: the same transformers model's full forward
over the whole trajectory (teacher-forced), the symbol tokenizer's own encoding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from gspo_megatron.contracts.samples import FinishReason, Sample, SamplingParams, TurnSpan
from gspo_megatron.core.tool_call_formats import SYMBOL, ToolCall
from gspo_megatron.rollout.agents.agent import AgentContext
from gspo_megatron.rollout.agents.templates import SymbolTemplate
from gspo_megatron.rollout.agents.tools.base import ToolResult, ToolSpec
from gspo_megatron.rollout.agents.tools.calculator import Calculator
from gspo_megatron.rollout.agents.tools.runner import ToolRunner
from gspo_megatron.rollout.agents.trajectories import AGENT_STATS, TrajectoryRunner, trajectory_metrics
from gspo_megatron.rollout.config import AgentConfig, EmbeddedConfig
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.pack import pack_samples
from gspo_megatron.rollout.rewards.types import RewardResult

TOKENIZER = SymbolTokenizer(96)
TEMPLATE = SymbolTemplate(TOKENIZER)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=7, return_routed_experts=True)


def model(seed: int) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    source = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in source.named_parameters():
            parameter.uniform_(0.5, 1.5) if name.endswith("norm.weight") else parameter.normal_(0.0, 0.35)
    return source


def engine(source, **config) -> EmbeddedEngine:
    built = EmbeddedEngine(source.config, EmbeddedConfig(**config), TOKENIZER.decode)
    built.update_weights(source.state_dict().items(), version=1)
    return built


def records(*prompts: str) -> list[PromptRecord]:
    return [PromptRecord(p, "0", {}, tuple(TOKENIZER.encode(p))) for p in prompts]


def runner(eng, agent, tools=(), **config) -> TrajectoryRunner:
    values = {"name": "tool_calling", "max_turns": 3, "max_tokens": 40, **config}
    return TrajectoryRunner(
        eng, agent, TEMPLATE, lambda record: ToolRunner(tools), AgentConfig(**values), TOKENIZER.decode
    )


def scripted(answers: list[str], update_to=None):
    """An agent that takes ``len(answers) + 1`` turns whatever the model writes, inserting each answer
    after a turn (as a tool's); with ``update_to`` the engine's weights change after the first turn."""

    async def agent(ctx: AgentContext) -> None:
        for turn, answer in enumerate(answers):
            await ctx.conversation.generate(ctx.turn_params())
            if update_to is not None and turn == 0:
                update_to[0].update_weights(update_to[1].state_dict().items(), version=2)
            ctx.conversation.insert(TEMPLATE.tool_answers([("calculator", ToolResult(answer))]))
        await ctx.conversation.generate(ctx.turn_params())

    return agent


def full_forward(source, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each next token [len - 1], sorted top-k experts of every position but the last)."""
    with torch.no_grad():
        out = source(input_ids=torch.tensor([ids]), output_router_logits=True)
    log_probs = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    k = source.config.num_experts_per_tok
    experts = torch.stack([torch.topk(logits, k, dim=-1).indices for logits in out.router_logits], dim=1)
    return log_probs, experts[:-1].sort(-1).values.to(torch.int32)


def test_a_trajectory_is_the_engines_tokens_with_the_inserted_between_and_scores_like_one_forward():
    source = model(1)
    (grouped,) = [g for g in runner(engine(source), scripted(["42", "7"])).generate(records("add 3 4:"), PARAMS)][:1]
    for sample in grouped:
        assert len(sample.turns) == 3
        inserted = TEMPLATE.tool_answers([("calculator", ToolResult("42"))])
        first, second = sample.turns[0], sample.turns[1]
        # token in, token out: the inserted ids sit exactly between the turns' generated ids
        assert sample.output_ids[first.end : second.start] == inserted
        assert sample.inserted_mask[first.end : second.start].all() and not sample.inserted_mask[: first.end].any()
        assert (sample.output_log_probs[sample.inserted_mask] == 0).all()
        log_probs, experts = full_forward(source, sample.prompt_ids + sample.output_ids)
        generated = ~sample.inserted_mask
        p = len(sample.prompt_ids)
        # every generated token's engine log-prob is the full forward's (the trainer's recomputation)
        torch.testing.assert_close(sample.output_log_probs[generated], log_probs[p - 1 :][generated], atol=1e-4, rtol=0)
        # one row per fed position, each the one of the forward that computed its KV (one set of weights)
        assert torch.equal(sample.routed_experts.sort(-1).values, experts)


def test_turns_on_two_weight_versions_keep_the_earlier_turns_routing():
    first_weights, second_weights = model(1), model(2)
    eng = engine(first_weights)
    (grouped,) = runner(eng, scripted(["42"], update_to=(eng, second_weights))).generate(records("add 3 4:"), PARAMS)
    differs = 0
    for sample in grouped:
        first, second = sample.turns
        assert (first.weight_version, second.weight_version) == (1, 2)
        fed_by_first = len(sample.prompt_ids) + first.end - 1  # positions the first turn's forwards fed
        _, under_first = full_forward(first_weights, sample.prompt_ids + sample.output_ids[: first.end])
        _, under_second = full_forward(second_weights, sample.prompt_ids + sample.output_ids)
        held = sample.routed_experts.sort(-1).values
        assert torch.equal(held[:fed_by_first], under_first)  # not overwritten by the later call
        differs += int(not torch.equal(under_second[:fed_by_first], under_first))
        versions = sample.extra["token_versions"]
        assert versions[: first.end] == [1] * first.end
        assert versions[second.start :] == [2] * (second.end - second.start)
        assert sample.weight_version == 1  # the oldest of its tokens
    assert differs  # the second weights route those positions otherwise: an overwrite would be caught


def test_the_same_seed_draws_the_same_trajectories_whatever_the_batching():
    source = model(1)
    together = runner(engine(source), scripted(["1"])).generate(records("add 3 4:", "max 91:"), PARAMS)
    # one trajectory per engine batch: other padding, other batch shapes, the same draws
    alone = runner(engine(source, max_batch_size=1), scripted(["1"])).generate(records("add 3 4:", "max 91:"), PARAMS)
    for a, b in zip([s for g in together for s in g], [s for g in alone for s in g], strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.output_log_probs, b.output_log_probs, atol=1e-4, rtol=0)


def test_inserted_tokens_are_out_of_the_loss_and_the_engine_comparison():
    source = model(1)
    samples = [s for g in runner(engine(source), scripted(["42"])).generate(records("add 3 4:"), PARAMS) for s in g]
    batch = pack_samples(samples, torch.zeros(2), torch.zeros(2), torch.zeros(2), TOKENIZER.pad_token_id, True)
    for row, sample in enumerate(samples):
        p, r = len(sample.prompt_ids), len(sample.output_ids)
        generated = (~sample.inserted_mask).float()
        assert torch.equal(batch.response_mask[row, p - 1 : p + r - 1], generated)
        assert torch.equal(batch.mismatch_mask[row, p - 1 : p + r - 1], generated)
        assert batch.response_mask[row].sum() == generated.sum()  # GSPO's |y_i|: generated tokens only


def test_each_input_position_is_tagged_with_the_turn_whose_engine_call_fed_it_by_hand():
    # prompt a b c; turn 0 generates o0 o1; inserted i0 i1; turn 1 generates o2 o3 o4. Fed positions 0..8:
    # turn 0's prefill feeds a b c (0-2), its decode o0 (3); turn 1's prefill o1 i0 i1 (4-6), its decode o2 o3
    # (7-8); o4 is never fed. A single-turn sample is one turn; padding is -1
    multi = Sample(
        [1, 2, 3], [4, 5, 6, 7, 8, 9, 10], torch.zeros(7), FinishReason.STOP,
        inserted_mask=torch.tensor([False, False, True, True, False, False, False]),
        turns=[TurnSpan(0, 2, 1), TurnSpan(4, 7, 1)],
    )  # fmt: skip
    single = Sample([1, 2], [4, 5], torch.zeros(2), FinishReason.STOP, turns=[TurnSpan(0, 2, 1)])
    batch = pack_samples([multi, single], torch.zeros(2), torch.zeros(2), torch.zeros(2), 0)
    assert batch.input_turns.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, -1, -1, -1, -1, -1, -1]]
    # the targets a turn generated are scored at its own positions (o0 o1 at 2-3, o2 o3 o4 at 6-8)
    generated = batch.response_mask[0].bool()
    assert batch.input_turns[0][generated].tolist() == [0, 0, 1, 1, 1]
    single_turn = Sample([1, 2], [4, 5], torch.zeros(2), FinishReason.STOP)
    assert pack_samples([single_turn], torch.zeros(1), torch.zeros(1), torch.zeros(1), 0).input_turns is None


def test_the_positions_tagged_with_a_turn_are_those_its_engine_call_returned_rows_for():
    conversations = []
    agent = scripted(["42", "7"])

    async def keeps_its_conversation(ctx: AgentContext) -> None:
        conversations.append(ctx.conversation)
        await agent(ctx)

    samples = [
        s for g in runner(engine(model(1)), keeps_its_conversation).generate(records("add 3 4:"), PARAMS) for s in g
    ]
    batch = pack_samples(samples, torch.zeros(2), torch.zeros(2), torch.zeros(2), TOKENIZER.pad_token_id, True)
    for row, conversation in enumerate(conversations):
        rows_per_call = [len(rows) for rows in conversation.routing]  # each turn's engine call, as returned
        tagged = [int((batch.input_turns[row] == t).sum()) for t in range(len(rows_per_call))]
        assert len(rows_per_call) == 3 and tagged == rows_per_call


def test_the_tool_calling_agent_runs_the_calls_a_turn_writes_and_inserts_their_answers():
    async def writes_a_call_then_answers(ctx: AgentContext) -> None:
        # the model's own turns would be random here: the turns' texts are what a model might have written
        ctx.conversation.insert(TOKENIZER.encode(SYMBOL.render(ToolCall("calculator", {"input": "17*514"}))))
        (call,) = ctx.parse(ctx.conversation.output_ids).calls
        result = await ctx.call_tool(call)
        ctx.conversation.insert(ctx.template.tool_answers([(call.name, result)]))
        await ctx.conversation.generate(ctx.turn_params())

    samples = [
        s
        for g in runner(engine(model(1)), writes_a_call_then_answers, tools=[Calculator()]).generate(
            records("17*514="), PARAMS
        )
        for s in g
    ]
    for sample in samples:
        text = TOKENIZER.decode(sample.output_ids)
        assert text.startswith("<calculator 17*514> 8738\n")  # the calculator's answer, inserted
        assert sample.extra[AGENT_STATS]["tool_calls"] == 1


class Hangs:
    spec = ToolSpec("calculator", "hangs", {"type": "object", "properties": {"expression": {"type": "string"}}})
    timeout_s = 0.2

    def call(self, arguments):
        import time

        time.sleep(30)
        return ToolResult("never")


class Raises:
    spec = Hangs.spec
    timeout_s = 1.0

    def call(self, arguments):
        raise RuntimeError("the tool broke")


@pytest.mark.parametrize("tool, kind", [(Hangs(), "timeout"), (Raises(), "raised")])
def test_a_failing_tool_costs_its_trajectory_a_counted_error_never_the_run(tool, kind):
    source = model(1)
    call_text = SYMBOL.render(ToolCall("calculator", {"input": "1+1"}))

    async def calls_once(ctx: AgentContext) -> None:
        (call,) = SYMBOL.parse(call_text).calls
        result = await ctx.call_tool(call)
        ctx.conversation.insert(ctx.template.tool_answers([(call.name, result)]))
        await ctx.conversation.generate(ctx.turn_params())

    grouped = runner(engine(source), calls_once, tools=[tool]).generate(records("add 3 4:"), PARAMS)
    samples = [s for g in grouped for s in g]
    assert all(s.extra[AGENT_STATS]["tool_errors"] == {kind: 1} for s in samples)
    text = TOKENIZER.decode(samples[0].output_ids)
    assert f" error {kind}\n" in text  # the model reads the failure as the tool's answer
    scored = [RewardResult(0.0, False, True) for _ in samples]
    metrics = trajectory_metrics(samples, scored)
    assert metrics[f"agent/tool_errors/{kind}"] == 2 and metrics["agent/tool_used_frac"] == 1.0


def test_a_turn_never_overruns_the_trajectorys_token_budget():
    budgets = []

    async def long_turns(ctx: AgentContext) -> None:
        while ctx.tokens_left > 0:
            params = ctx.turn_params()
            budgets.append((ctx.tokens_left, params.max_new_tokens))
            await ctx.conversation.generate(params)
            ctx.conversation.insert(TEMPLATE.tool_answers([("calculator", ToolResult("12"))]))

    grouped = runner(engine(model(1)), long_turns, max_tokens=12).generate(
        records("add 3 4:"), dataclasses.replace(PARAMS, max_new_tokens=8)
    )
    assert budgets[0] == (12, 8) and all(max_new == min(8, left) for left, max_new in budgets)
    for sample in (s for g in grouped for s in g):
        generated = [span.end - span.start for span in sample.turns]
        assert all(n <= 8 for n in generated) and len(sample.output_ids) <= 12 + 4  # the last answer is cut off


def test_a_trajectory_that_fails_before_its_first_turn_is_packed_with_no_routing_to_compare(caplog):
    # an agent's client can fail before its first request is answered (CI 2026-12-06: a connection reset):
    # the trajectory is an empty answer that no engine call fed, and the step packs for routing replay and
    # the rollout_vs_train diagnostic without it (the run failed: "a sample has none")
    agent = scripted(["42"])

    async def fails_on_the_second(ctx: AgentContext) -> None:
        if ctx.conversation.seed == PARAMS.seed + 1_000_033:  # the record's second trajectory
            raise ConnectionResetError("the client's connection was reset")
        await agent(ctx)

    with caplog.at_level("WARNING"):
        grouped = runner(engine(model(1)), fails_on_the_second).generate(records("add 3 4:"), PARAMS)
    ok, failed = grouped[0]
    assert failed.turns == [] and failed.output_ids == [] and failed.routed_experts is None
    assert "ConnectionResetError" in failed.extra[AGENT_STATS]["error"]
    assert "1 of 2 trajectories ended with an error" in caplog.text and "connection was reset" in caplog.text
    batch = pack_samples([ok, failed], torch.zeros(2), torch.zeros(2), torch.zeros(2), TOKENIZER.pad_token_id, True)
    fed_ok = len(ok.prompt_ids) + len(ok.output_ids) - 1
    assert torch.equal(batch.routed_experts[0, :fed_ok], ok.routed_experts)
    p = len(failed.prompt_ids)
    assert batch.input_mask[1].sum() == p - 1 and batch.response_mask[1].sum() == 0  # fed, nothing trained
    assert batch.input_turns[1].tolist() == [-1] * batch.input_turns.shape[1]  # no engine call fed it
    assert batch.routed_experts[1, : p - 1].tolist() == [[[0, 1]] * 2] * (p - 1)  # a valid top-k, as padding


def test_a_sample_without_routing_that_an_engine_call_fed_is_still_refused():
    fed_but_lost = Sample([1, 2], [4, 5], torch.zeros(2), FinishReason.STOP, turns=[TurnSpan(0, 2, 1)])
    single = Sample([1, 2], [4, 5], torch.zeros(2), FinishReason.STOP)
    for sample in (fed_but_lost, single):
        with pytest.raises(ValueError, match="needs routed experts from the engine"):
            pack_samples([sample], torch.zeros(1), torch.zeros(1), torch.zeros(1), 0, True)
    empty = Sample([1, 2, 3], [], torch.zeros(0), FinishReason.ABORT, turns=[])
    with pytest.raises(ValueError, match="every one of the step's 2 trajectories ended before its first turn"):
        pack_samples([empty, empty], torch.zeros(2), torch.zeros(2), torch.zeros(2), 0, True)
