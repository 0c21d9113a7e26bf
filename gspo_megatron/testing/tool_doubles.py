"""Agent tools that are wrong on purpose, importable by path (``rollout.agent.tools=[import:...]``): each
breaks one rule of ``rollout/agents/tools/user_tools.py``'s start-up check."""

from __future__ import annotations

from typing import Any

from gspo_megatron.rollout.agents.tools.base import ToolResult, ToolSpec


class NoSpec:
    """Has a call but no ToolSpec: not a tool."""

    timeout_s = 1.0

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult("ok")


class NoSchema(NoSpec):
    """A spec whose parameters are not an object's JSON schema."""

    spec = ToolSpec("noschema", "a string schema", {"type": "string"})


class NamedCalculator(NoSpec):
    """A well-formed tool that takes the built-in calculator's name."""

    spec = ToolSpec("calculator", "another calculator", {"type": "object", "properties": {}})


class NoTimeout(NamedCalculator):
    """A well-formed spec with no bound on a call's time."""

    spec = ToolSpec("notimeout", "never bounded", {"type": "object", "properties": {}})
    timeout_s = 0.0


def fails_to_build() -> NoSpec:
    raise RuntimeError("the weather service is not configured")
