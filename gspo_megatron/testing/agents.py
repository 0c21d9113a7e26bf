"""Agents for tests: trajectories of several turns whatever a random model writes, so the multi-turn path
(inserted tokens, routing spliced per turn, the masks) is exercised by every trajectory of a tiny run."""

from __future__ import annotations

from gspo_megatron.core.tool_call_formats import ToolCall
from gspo_megatron.rollout.agents.agent import AgentContext


async def calls_the_calculator_twice(ctx: AgentContext) -> None:
    """Turn, a calculator call on the prompt's expression (inserted, as if the model had written it) and its
    answer, turn, again, turn: three generated turns, two inserted answers."""
    expression = ctx.record.prompt.rstrip("=")
    for _ in range(2):
        await ctx.conversation.generate(ctx.turn_params())
        call = ToolCall("calculator", {"expression": expression})
        ctx.conversation.insert(ctx.template.tool_answers([(call.name, await ctx.call_tool(call))]))
    await ctx.conversation.generate(ctx.turn_params())
