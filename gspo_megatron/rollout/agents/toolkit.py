"""The tools one trajectory may call (``rollout.agent.tools``), built once per run and handed out per record.

The calculator and the lookup hold no state and are shared; the Python sandbox gets a scratch directory of
its own per trajectory (under ``rollout.agent.scratch_dir``, or a temporary directory the run removes), so
one trajectory's files are never another's. A user's tool (``import:package.module:Name``,
``tools/user_tools.py``) is built once per trajectory. The model is shown the built-ins first (calculator,
lookup, python), then the user's tools in the order the config names them.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

from gspo_megatron.rollout.agents.tools.base import Tool, ToolSpec
from gspo_megatron.rollout.agents.tools.runner import ToolRunner
from gspo_megatron.rollout.agents.tools.user_tools import (
    TOOLS_KEY,
    UserTool,
    check_unique_names,
    is_user_tool,
    load_user_tool,
)
from gspo_megatron.rollout.config import AgentConfig
from gspo_megatron.rollout.data.records import PromptRecord


class ToolKit:
    def __init__(self, config: AgentConfig):
        from gspo_megatron.rollout.agents.tools.calculator import Calculator
        from gspo_megatron.rollout.agents.tools.corpus import CorpusLookup

        self.config = config
        self.shared: list[Tool] = []
        if "calculator" in config.tools:
            self.shared.append(Calculator())
        if "lookup" in config.tools:
            if config.corpus_dir is None:
                raise ValueError("rollout.agent.tools has lookup, which needs rollout.agent.corpus_dir")
            self.shared.append(CorpusLookup(config.corpus_dir))
        self.python = "python" in config.tools
        self.user_tools = load_user_tools(config)
        self._scratch_root: tempfile.TemporaryDirectory | None = None
        self._trajectories = itertools.count()

    def specs(self) -> list[ToolSpec]:
        """What the model is told about its tools (the chat template renders them)."""
        specs = [tool.spec for tool in self.shared]
        if self.python:
            from gspo_megatron.rollout.agents.tools.python_sandbox import PythonSandbox

            specs.append(PythonSandbox(self._scratch()).spec)  # the root's: every trajectory's sandbox says the same
        return specs + [tool.spec for tool in self.user_tools]

    def for_record(self, record: PromptRecord | None) -> ToolRunner:
        """A trajectory's tools (the same for every record of a run; a task's own could differ here)."""
        tools = list(self.shared)
        if self.python:
            from gspo_megatron.rollout.agents.tools.python_sandbox import PythonSandbox

            tools.append(PythonSandbox(self._scratch() / f"trajectory_{next(self._trajectories)}"))
        return ToolRunner(tools + [tool.build() for tool in self.user_tools])

    def _scratch(self) -> Path:
        if self.config.scratch_dir is not None:
            return Path(self.config.scratch_dir)
        if self._scratch_root is None:
            self._scratch_root = tempfile.TemporaryDirectory(prefix="gspo_tools_")
        return Path(self._scratch_root.name)


def load_user_tools(config: AgentConfig) -> list[UserTool]:
    """The user's tools of ``rollout.agent.tools``, imported, built once and checked, with every tool's name
    told apart (a user's tool named like a built-in, or two entries of one tool, are refused)."""
    user_tools = [load_user_tool(entry, i) for i, entry in enumerate(config.tools) if is_user_tool(entry)]
    builtins = [(entry, f"{TOOLS_KEY}[{i}]={entry}") for i, entry in enumerate(config.tools) if not is_user_tool(entry)]
    check_unique_names(builtins + [(tool.spec.name, tool.key) for tool in user_tools])
    return user_tools
