"""Agents for tests: trajectories of several turns whatever a random model writes, so the multi-turn path
(inserted tokens, routing spliced per turn, the masks) is exercised by every trajectory of a tiny run."""

from __future__ import annotations

import json
from typing import Any

from gspo_megatron.core.tool_call_formats import ToolCall
from gspo_megatron.rollout.agents.agent import AgentContext
from gspo_megatron.rollout.agents.tools.calculator import Calculator
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.rewards.types import RewardResult


async def calls_the_calculator_twice(ctx: AgentContext) -> None:
    """Turn, a calculator call on the prompt's expression (inserted, as if the model had written it) and its
    answer, turn, again, turn: three generated turns, two inserted answers."""
    expression = ctx.record.prompt.rstrip("=")
    for _ in range(2):
        await ctx.conversation.generate(ctx.turn_params())
        call = ToolCall("calculator", {"expression": expression})
        ctx.conversation.insert(ctx.template.tool_answers([(call.name, await ctx.call_tool(call))]))
    await ctx.conversation.generate(ctx.turn_params())


async def looks_up_the_entity(ctx: AgentContext) -> None:
    """The ``fact_lookup`` task's trajectory whatever a random model writes: turn, a lookup of the record's entity
    (inserted, as if the model had called it) and the entity's document, turn: two turns, one inserted answer."""
    await ctx.conversation.generate(ctx.turn_params())
    call = ToolCall("lookup", {"query": ctx.record.metadata["entity"]})
    ctx.conversation.insert(ctx.template.tool_answers([(call.name, await ctx.call_tool(call))]))
    await ctx.conversation.generate(ctx.turn_params())


async def fails_at_once_on_every_third(ctx: AgentContext) -> None:
    """``calls_the_calculator_twice``, but every third trajectory (by its seed) fails before its first turn, as
    a user's client does when its connection drops: an empty answer that no engine call fed."""
    if ctx.conversation.seed % 3 == 0:
        raise ConnectionResetError("the agent's client lost its connection before its first turn")
    await calls_the_calculator_twice(ctx)


def openai_client_agent(base_url: str, api_key: str, record: PromptRecord, tools: list[dict]) -> None:
    """An agent written against the OpenAI Python client (``rollout.agent.name=openai_endpoint``): ask; answer
    the tool calls the reply makes with the calculator (or, when it makes none, ask the model to check its
    answer, as a user would); ask again. Two turns per trajectory whatever a random model writes."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    schemas: Any = tools  # the OpenAI tool schemas, as dicts
    messages: list[Any] = [{"role": "user", "content": record.prompt}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=schemas).choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    calculator = Calculator()
    for call in reply.tool_calls or []:
        try:
            assert call.type == "function"  # the endpoint returns function calls only
            result = calculator.call(json.loads(call.function.arguments or "{}")).content
        except (ValueError, TypeError) as error:  # arguments that are not a JSON object
            result = f"error: {error}"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    if not reply.tool_calls:
        messages.append({"role": "user", "content": "check your answer"})
    client.chat.completions.create(model="policy", messages=messages, tools=schemas)


def odd_turns(response: str, record: PromptRecord) -> RewardResult:
    """A reward that reads a trajectory's turns (``record.trajectory``): each turn scores 1 when its text has an
    odd length, the trajectory 1 when its last turn has a digit; whatever a random model writes, rewards vary."""
    turns = record.trajectory.turns if record.trajectory is not None else ()
    return RewardResult(
        float(any(c.isdigit() for c in response)),
        any(c.isdigit() for c in response),
        True,
        turn_rewards=tuple(float(len(text) % 2) for text in turns) if record.trajectory is not None else None,
    )


async def calls_the_calculator_by_the_prompt(ctx: AgentContext) -> None:
    """``calls_the_calculator_twice`` with 1 + (the prompt's digit sum mod 3) turns, whatever a random model
    writes: a step's groups end after different numbers of turns, so over-sampling cuts the longer ones
    between turns and carries them (``rollout/agents/carried.py``)."""
    expression = ctx.record.prompt.rstrip("=")
    turns = 1 + sum(int(c) for c in expression if c.isdigit()) % 3
    for _ in range(turns - 1):
        await ctx.conversation.generate(ctx.turn_params())
        call = ToolCall("calculator", {"expression": expression})
        ctx.conversation.insert(ctx.template.tool_answers([(call.name, await ctx.call_tool(call))]))
    await ctx.conversation.generate(ctx.turn_params())
