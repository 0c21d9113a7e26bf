"""How a model writes a tool call, as data: one ``ToolCallFormat`` per format, beside the model families
(``model_families.py``) that use them.

- ``hermes_json`` -- Qwen2.5/Qwen3 (and the Hermes template they took it from): a call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; several may follow each
  other in one turn. The tool's answer goes back as a ``tool`` message the chat template renders.
- ``symbol`` -- the built-in symbol tokenizer's tasks (no JSON in its alphabet): ``<name argument>``,
  one call per turn, its one argument the rest of the text; the answer follows as `` text\n``.

A turn's text is parsed after the engine stopped on ``stop``; text that opens a call and does not parse
is a malformed call (the agent counts it and may show the model the error), never an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A generated turn's text split into what the model said and the calls it made."""

    content: str  # the text outside the calls
    calls: list[ToolCall]
    malformed: list[str]  # call texts that did not parse (why, one line each)


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    open: str  # what starts a call
    close: str  # what ends it: the engine stops on it
    argument: str | None = None  # ``symbol``: the one argument's key (``None``: JSON objects carry their own)

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings that end a turn at a call's end (the text is kept: it completes the call)."""
        return (self.close,)

    def parse(self, text: str) -> ParsedTurn:
        calls, malformed, outside = [], [], []
        position = 0
        for match in re.finditer(re.escape(self.open) + r"(.*?)(" + re.escape(self.close) + r"|$)", text, re.S):
            outside.append(text[position : match.start()])
            position = match.end()
            body = match.group(1)
            if not match.group(2):
                malformed.append(f"a call opened with {self.open!r} and not closed with {self.close!r}")
                continue
            call, problem = self._call(body)
            if call is None:
                malformed.append(problem)
            else:
                calls.append(call)
        outside.append(text[position:])
        return ParsedTurn("".join(outside).strip(), calls, malformed)

    def _call(self, body: str) -> tuple[ToolCall | None, str]:
        if self.argument is not None:  # "<name argument>"
            name, _, argument = body.strip().partition(" ")
            if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
                return None, f"a call's name must be a word, got {name!r}"
            return ToolCall(name, {self.argument: argument.strip()}), ""
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            return None, f"a call is not JSON ({error.msg} at {error.pos})"
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None, 'a call must be an object with a "name" string'
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None, "a call's arguments are a string that is not JSON"
        if not isinstance(arguments, dict):
            return None, 'a call\'s "arguments" must be an object'
        return ToolCall(value["name"], arguments), ""

    def render(self, call: ToolCall) -> str:
        """The text of ``call`` as the model writes it (demonstrations and tests)."""
        if self.argument is not None:
            return f"{self.open}{call.name} {call.arguments.get(self.argument, '')}{self.close}"
        return f"{self.open}\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n{self.close}"


HERMES_JSON = ToolCallFormat("hermes_json", "<tool_call>", "</tool_call>")
SYMBOL = ToolCallFormat("symbol", "<", ">", argument="input")

TOOL_CALL_FORMATS = {f.name: f for f in (HERMES_JSON, SYMBOL)}
# the format each family's chat template writes (the symbol tokenizer's tasks use SYMBOL whatever the family)
FAMILY_TOOL_CALL_FORMAT = {
    "qwen3_moe": HERMES_JSON.name,
    "qwen2_moe": HERMES_JSON.name,
}


def tool_call_format(name: str) -> ToolCallFormat:
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; valid: {', '.join(TOOL_CALL_FORMATS)}") from None
