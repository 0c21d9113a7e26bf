"""The agent interface: one async function per trajectory, and the built-in tool-calling agent.

    async def my_agent(ctx: AgentContext) -> None:
        turn = await ctx.conversation.generate(ctx.turn_params())      # the model's turn
        for call in ctx.parse(turn).calls:                              # the calls it wrote
            answer = await ctx.call_tool(call)                          # bounded, never raises
            ...
        ctx.conversation.insert(ctx.template.tool_answers(answers))    # token-in-token-out

An agent gets the trajectory's ``Conversation`` (its tokens; generating a turn goes through the shared
engine batcher), the task's record, the tools and the turn template, and returns when the trajectory is
done; what the conversation holds then is the sample (``Conversation.sample``). ``rollout.agent.name``
names a built-in (``tool_calling``) or a user's function as ``import:package.module:function``.

Design decisions:
- Limits are the agent's to keep but the context enforces the hard ones: ``turn_params`` never lets a
  turn overrun the trajectory's token budget, and the runner ends a trajectory past its timeout.
- A tool's failure is the trajectory's, never the run's: ``call_tool`` returns the error as a result (counted
  by kind); the built-in agent then shows it to the model or ends the trajectory (``on_tool_error``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.core.tool_call_formats import ParsedTurn, ToolCall
from gspo_megatron.rollout.agents.batcher import TurnBatcher
from gspo_megatron.rollout.agents.conversation import Conversation
from gspo_megatron.rollout.agents.templates import TurnTemplate
from gspo_megatron.rollout.agents.tools.base import ToolResult
from gspo_megatron.rollout.agents.tools.runner import ToolRunner
from gspo_megatron.rollout.config import AgentConfig, ToolErrorPolicy
from gspo_megatron.rollout.data.records import PromptRecord


@dataclass
class AgentContext:
    """One trajectory's agent's world, and what it counts."""

    conversation: Conversation
    record: PromptRecord
    tools: ToolRunner
    template: TurnTemplate
    params: SamplingParams  # the run's sampling; ``max_new_tokens`` is one turn's budget
    config: AgentConfig
    decode: Callable[[list[int]], str]
    batcher: TurnBatcher
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)  # by kind (tools/base.py: TOOL_ERRORS)
    malformed_calls: int = 0

    @property
    def tokens_left(self) -> int:
        """What the trajectory may still add after its prompt (``rollout.agent.max_tokens``)."""
        return self.config.max_tokens - len(self.conversation.output_ids)

    def turn_params(self) -> SamplingParams:
        """The next turn's sampling: the run's, within the trajectory's budget, stopping at a call's end."""
        stop = tuple(self.params.stop) + self.template.format.stop
        return dataclasses.replace(
            self.params, max_new_tokens=max(1, min(self.params.max_new_tokens, self.tokens_left)), stop=stop
        )

    def parse(self, output_ids: list[int]) -> ParsedTurn:
        """The calls a turn wrote; a turn that ended on a stop token (EOS) ended there: what it wrote is its
        answer, and the stop token's own text is no call (the symbol tokenizer's ``<eos>``)."""
        if output_ids and output_ids[-1] in self.params.stop_token_ids:
            output_ids = output_ids[:-1]
        parsed = self.template.format.parse(self.decode(output_ids))
        self.malformed_calls += len(parsed.malformed)
        return parsed

    async def call_tool(self, call: ToolCall) -> ToolResult:
        """The tool's answer (its failure as a result, counted); the batcher knows this trajectory waits."""
        arguments = dict(call.arguments)
        key = self.template.format.argument
        if key is not None and key in arguments:  # one-argument formats: the tool's first required key
            arguments = {self.tools.first_required(call.name) or key: arguments[key]}
        self.tool_calls += 1
        with self.batcher.tool_call():
            result = await self.tools.call(call.name, arguments)
        if result.error is not None:
            self.tool_errors[result.error] += 1
        return result


Agent = Callable[[AgentContext], Awaitable[None]]


async def tool_calling_agent(ctx: AgentContext) -> None:
    """Generate; run the calls the turn wrote; insert their answers; again, until a turn calls nothing,
    ``max_turns`` turns were generated or the token budget is spent."""
    for _ in range(ctx.config.max_turns):
        if ctx.tokens_left < 1:
            return
        turn = await ctx.conversation.generate(ctx.turn_params())
        parsed = ctx.parse(turn.output_ids)
        if not parsed.calls:
            return  # the final answer
        answers = [(call.name, await ctx.call_tool(call)) for call in parsed.calls]
        failed = any(result.error is not None for _, result in answers)
        if failed and ctx.config.on_tool_error == ToolErrorPolicy.end:
            return
        ctx.conversation.insert(ctx.template.tool_answers(answers))


BUILTIN_AGENTS: dict[str, Agent] = {"tool_calling": tool_calling_agent}
