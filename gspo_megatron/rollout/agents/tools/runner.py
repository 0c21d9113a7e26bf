"""The runner every tool call goes through: it checks the arguments, runs the call off the event loop,
bounds its time and the size of its answer, and turns every failure into a ``ToolResult`` error.

Design decisions:
- Arguments are checked against the tool's schema minimally and without a jsonschema dependency: an
  object; its ``required`` keys present; a property whose ``"type"`` is one simple type (string,
  integer, number, boolean, array, object) has a value of that type (a bool is not an integer or a
  number, as in JSON); ``"additionalProperties": false`` refuses other keys. Anything richer
  (enums, ranges, nested schemas) is the tool's own check.
- A call runs in its own daemon thread (``agents/daemon_thread.py``: why not ``asyncio.to_thread``);
  ``asyncio.wait_for`` bounds it at the tool's ``timeout_s``. Python cannot stop a thread, so a call past
  its time is abandoned, not stopped: it runs on until it returns and its answer is dropped. Hence an
  in-process tool must bound its own work (the calculator bounds exponents and magnitudes) and a tool
  that runs code runs it in a process it can kill (``python_sandbox.py``, whose ``timeout_s`` exceeds its
  own wall limit).
- An answer's size is counted in UTF-8 bytes (what the tokenizer sees), error messages included; one
  over ``max_result_bytes`` becomes ``too_large`` with its size, never its text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gspo_megatron.rollout.agents.daemon_thread import in_daemon_thread
from gspo_megatron.rollout.agents.tools.base import Tool, ToolResult, ToolSpec

DEFAULT_MAX_RESULT_BYTES = 16384
MAX_MESSAGE_CHARS = 1000  # an exception's message shown to the model is cut here

# JSON schema's simple types and the Python values json.loads gives for them
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def check_arguments(schema: Mapping[str, Any], arguments: object) -> str | None:
    """Why ``arguments`` does not fit ``schema`` (a message for the model), or None when they fit."""
    if not isinstance(arguments, dict):
        return f"the arguments must be a JSON object, got {type(arguments).__name__}"
    missing = [key for key in schema.get("required", ()) if key not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    properties: Mapping[str, Any] = schema.get("properties", {})
    if schema.get("additionalProperties") is False:
        unknown = sorted(key for key in arguments if key not in properties)
        if unknown:
            return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(properties)}"
    for key, value in arguments.items():
        expected = properties.get(key, {}).get("type")
        if isinstance(expected, str) and expected in _JSON_TYPES and not _has_type(value, expected):
            article = "an" if expected[0] in "aeiou" else "a"
            return f"argument {key!r} must be {article} {expected}, got {type(value).__name__}"
    return None


def _has_type(value: object, expected: str) -> bool:
    if isinstance(value, bool) and expected != "boolean":  # bool subclasses int; JSON keeps them apart
        return False
    return isinstance(value, _JSON_TYPES[expected])


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))  # a lone surrogate counts, it does not raise


class ToolRunner:
    """The tools of one agent, by name, and the one way to call them (``await runner.call(name, args)``)."""

    def __init__(self, tools: Iterable[Tool] = (), max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES):
        if max_result_bytes <= 0:
            raise ValueError(f"max_result_bytes must be > 0, got {max_result_bytes}")
        self.max_result_bytes = max_result_bytes
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        name = tool.spec.name
        if name in self._tools:
            raise ValueError(f"a tool named {name!r} is already registered")
        self._tools[name] = tool

    def tools(self) -> list[Tool]:
        """The tools in registration order."""
        return list(self._tools.values())

    def specs(self) -> list[ToolSpec]:
        """The tools' specs in registration order (what the chat template shows the model)."""
        return [tool.spec for tool in self._tools.values()]

    def first_required(self, name: str) -> str | None:
        """The first required argument of tool ``name`` (None: no such tool, or none required): where a
        one-argument call format (``core/tool_call_formats.py:SYMBOL``) puts its argument."""
        tool = self._tools.get(name)
        required = tool.spec.parameters.get("required", []) if tool is not None else []
        return str(required[0]) if required else None

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """The tool's answer, or a ``ToolResult`` naming what went wrong; never raises for the tool's sake."""
        tool = self._tools.get(name)
        if tool is None:
            valid = ", ".join(self._tools) or "(none)"
            return ToolResult(f"unknown tool {name!r}; the tools are: {valid}", error="unknown_tool")
        problem = check_arguments(tool.spec.parameters, arguments)
        if problem is not None:
            return ToolResult(f"{name}: {problem}", error="bad_arguments")
        try:
            call = in_daemon_thread(_calling(tool, arguments), f"tool-{tool.spec.name}")
            result = await asyncio.wait_for(call, tool.timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from 3.11 on
            return ToolResult(f"{name}: no answer within {tool.timeout_s:g} s", error="timeout")
        if not isinstance(result, ToolResult):
            return ToolResult(f"{name} returned a {type(result).__name__}, not a ToolResult", error="raised")
        size = utf8_size(result.content)
        if size > self.max_result_bytes:
            return ToolResult(
                f"{name}: the answer was {size} bytes, over the limit of {self.max_result_bytes}", error="too_large"
            )
        return result


def _calling(tool: Tool, arguments: dict[str, Any]) -> Callable[[], object]:
    """``tool.call(arguments)``, an exception turned into a ``raised`` result (a tool's failure is its result,
    not the run's), so only answers cross to the loop."""

    def call() -> object:
        try:
            return tool.call(arguments)
        except BaseException as exc:  # noqa: BLE001 - SystemExit too
            message = f"{type(exc).__name__}: {exc}"[:MAX_MESSAGE_CHARS]
            return ToolResult(f"{tool.spec.name} raised {message}", error="raised")

    return call
