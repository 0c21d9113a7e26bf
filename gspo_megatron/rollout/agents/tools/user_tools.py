"""A user's own tools, named in ``rollout.agent.tools`` beside the built-ins as ``import:package.module:Name``,
and the start-up check of what that name gives.

    rollout.agent.tools=[calculator,import:examples.agent_tool.tools:WordCount]

``Name`` is a class (or function) that takes no arguments and returns a tool: an object with ``spec`` (a
``ToolSpec``: name, description, the JSON schema of its arguments), ``timeout_s`` and ``call(arguments) ->
ToolResult`` (``tools/base.py``; docs/agents.md has a runnable example).

Design decisions:
- One loader for every user function: the entry is resolved by ``core/registry.import_function``, the one a
  user's reward and agent go through, so an import that fails, raises or exits reads the same everywhere.
- Checked at start-up (``config/validate.py``, before the run directory is claimed): the import, that the
  factory builds a tool (a ``ToolSpec``, a positive ``timeout_s``, a callable ``call``), that its schema is
  an object schema JSON can carry (``"type": "object"``, ``properties`` an object, ``required`` naming
  properties), and that no two tools share a name. Each error names the entry's key and the fix.
- The factory is called once per trajectory (``ToolKit.for_record``), so a tool may keep a trajectory's
  state (an environment, a scratch directory) and no two trajectories share it; its calls run in threads
  off the event loop (``runner.py``). Every instance must say what the start-up one said (the model was
  told that spec): one that differs fails the step, naming the entry.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gspo_megatron.core.registry import IMPORT_PREFIX, import_function
from gspo_megatron.rollout.agents.tools.base import Tool, ToolSpec

TOOLS_KEY = "rollout.agent.tools"
_INTERFACE = (
    "a class or function that takes no arguments and returns a tool: spec (a ToolSpec), timeout_s (seconds > 0) "
    "and call(arguments) -> ToolResult (gspo_megatron/rollout/agents/tools/base.py; docs/agents.md)"
)


class UserToolError(ValueError):
    """A user's tool entry that cannot serve (its import, what it builds, its schema, its name)."""


def is_user_tool(entry: str) -> bool:
    return entry.startswith(IMPORT_PREFIX)


@dataclass(frozen=True)
class UserTool:
    """One ``import:`` entry of ``rollout.agent.tools``: where it stands, its factory, and the spec its
    start-up instance showed (what the model is told)."""

    key: str  # "rollout.agent.tools[1]=import:pkg.module:Name", for errors
    factory: Callable[[], object]
    spec: ToolSpec

    def build(self) -> Tool:
        """A trajectory's instance, checked, and saying what the start-up one said."""
        tool = checked_tool(_built(self.factory, self.key), self.key)
        if tool.spec != self.spec:
            raise UserToolError(
                f"{self.key}: this instance's spec {tool.spec!r} differs from the start-up instance's {self.spec!r}, "
                "which the model was told; build the same spec every time"
            )
        return tool


def load_user_tool(entry: str, index: int) -> UserTool:
    """Entry ``index`` of ``rollout.agent.tools``, imported, built once and checked."""
    key = f"{TOOLS_KEY}[{index}]={entry}"
    try:
        factory = import_function(entry, "tool")
    except ValueError as error:
        raise UserToolError(f"{key}: {error}; the entry names {_INTERFACE}") from error
    tool = checked_tool(_built(factory, key), key)
    return UserTool(key, factory, tool.spec)


def checked_tool(tool: object, key: str) -> Tool:
    """``tool`` if it is one (``tools/base.py:Tool``) with an object schema JSON can carry; else why not."""
    spec = getattr(tool, "spec", None)
    if not isinstance(spec, ToolSpec):
        raise UserToolError(
            f"{key} built a {type(tool).__name__} whose spec is {type(spec).__name__}, not a ToolSpec; it must be "
            f"{_INTERFACE}"
        )
    if not callable(getattr(tool, "call", None)):
        raise UserToolError(
            f"{key} built a {type(tool).__name__} with no callable call(arguments); it must be {_INTERFACE}"
        )
    timeout = getattr(tool, "timeout_s", None)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) or timeout <= 0:
        raise UserToolError(
            f"{key}: timeout_s={timeout!r}; give the tool a finite timeout_s > 0 (seconds a call may take)"
        )
    if not spec.name or not all(c.isascii() and (c.isalnum() or c in "_-") for c in spec.name):
        raise UserToolError(
            f"{key}: tool name {spec.name!r}; use letters, digits, '_' and '-' (OpenAI's function names)"
        )
    problem = schema_problem(spec.parameters)
    if problem is not None:
        raise UserToolError(
            f"{key}: tool {spec.name!r} has no JSON schema of its arguments ({problem}); set ToolSpec.parameters to "
            'one, e.g. {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
        )
    return tool  # type: ignore[return-value]  # checked above: what Tool's protocol reads


def schema_problem(parameters: object) -> str | None:
    """Why ``parameters`` is not the JSON schema of an arguments object, or None."""
    if not isinstance(parameters, dict):
        return f"parameters is a {type(parameters).__name__}, not a dict"
    if parameters.get("type") != "object":
        return f'"type" is {parameters.get("type")!r}, not "object"'
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
        return '"properties" must map each argument to its schema (a dict)'
    required = parameters.get("required", [])
    if not isinstance(required, list) or any(name not in properties for name in required):
        return f'"required" must list names of "properties", got {required!r}'
    try:
        json.dumps(parameters)
    except (TypeError, ValueError) as error:
        return f"not JSON: {error}"
    return None


def check_unique_names(named: Sequence[tuple[str, str]]) -> None:
    """``named``: (tool name, the key that gives it), in config order. Two tools of one name are refused: the
    model could not tell which it calls."""
    first: dict[str, str] = {}
    for name, key in named:
        if name in first:
            raise UserToolError(
                f"{key} is a tool named {name!r}, as {first[name]} is; rename one (ToolSpec.name) or drop one entry"
            )
        first[name] = key


def _built(factory: Callable[[], object], key: str) -> object:
    try:
        return factory()
    except Exception as error:  # the user's constructor: name the entry, keep its traceback
        raise UserToolError(f"{key}: building the tool raised {type(error).__name__}: {error}") from error
