"""A user's own agent tool (docs/agents.md, "Your own tools"): the sum of a number's digits.

    python3 -m gspo_megatron.train +experiment=agent_calculator \
        'rollout.agent.tools=[calculator,import:examples.agent_tool.tools:DigitSum]'

The run imports ``DigitSum`` at start-up, builds one to check it (a ``ToolSpec`` with a JSON schema, a
``timeout_s``, a ``call``), shows the model its spec beside the calculator's, and builds one per trajectory.
"""

from __future__ import annotations

from typing import Any

from gspo_megatron.rollout.agents.tools.base import ToolResult, ToolSpec


class DigitSum:
    spec = ToolSpec(
        name="digitsum",  # the symbol tokenizer spells a tool's name in lowercase letters
        description="the sum of the decimal digits of a whole number",
        parameters={
            "type": "object",
            "properties": {"number": {"type": "string", "description": "a whole number, e.g. 4096"}},
            "required": ["number"],
        },
    )
    timeout_s = 1.0  # the most one call may take (the runner abandons it past this)

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        number = arguments["number"].strip().lstrip("-")
        if not number.isdigit() or len(number) > 1000:
            # a wrong input is the tool's answer, never an exception the run sees (an exception would be
            # shown to the model as "raised" and counted: agent/tool_errors/raised)
            return ToolResult(f"not a whole number: {arguments['number'][:40]!r}", error="bad_arguments")
        return ToolResult(str(sum(int(digit) for digit in number)))
