"""What a tool is: a name, a description and a JSON schema of its arguments (what the model is shown, in
OpenAI's function-calling shape), and a call from arguments to the text the model sees next.

Design decisions:
- A tool call never fails the run. Whatever goes wrong -- arguments that do not fit the schema, an
  exception, a hang, an answer too large -- comes back as a ``ToolResult`` with ``error`` set to one of
  ``TOOL_ERRORS``; the agent loop ends that trajectory (or shows the model the error, its choice) and the
  run counts the kind (``tool/errors/<kind>``).
- ``call`` is synchronous and may block; the runner (``runner.py``) runs it off the event loop with the
  tool's own timeout, so trajectories' tools overlap each other and the engine's generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# why a tool call failed (the metric keys ``tool/errors/<kind>``)
TOOL_ERRORS = ("bad_arguments", "unknown_tool", "raised", "timeout", "too_large", "refused", "crashed")


@dataclass(frozen=True)
class ToolSpec:
    """What the model is told about a tool (OpenAI's ``{"type": "function", "function": {...}}``)."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolResult:
    content: str  # what the model sees as the tool's answer (an error's message too)
    error: str | None = None  # one of TOOL_ERRORS; None: the call succeeded

    def __post_init__(self) -> None:
        if self.error is not None and self.error not in TOOL_ERRORS:
            raise ValueError(f"tool error {self.error!r} is not one of {', '.join(TOOL_ERRORS)}")


class Tool(Protocol):
    spec: ToolSpec
    timeout_s: float  # the most one call may take, its wall time (the runner enforces it)

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """The tool's answer to ``arguments`` (already checked against ``spec.parameters``'s required keys)."""
