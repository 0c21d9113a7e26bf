"""A user's own tool named by import path in ``rollout.agent.tools`` (``rollout/agents/tools/user_tools.py``):
a run with one composes and validates, its trajectory calls it through the real tool runner over the embedded
engine, and each way an entry can be wrong is refused at start-up (before the run directory is claimed),
naming the entry's key and the fix. The bad entries are ``gspo_megatron/testing/tool_doubles.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config.compose import compose
from gspo_megatron.config.validate import ConfigError, validate_config
from gspo_megatron.core.tool_call_formats import SYMBOL, ToolCall
from gspo_megatron.rollout.agents.agent import AgentContext
from gspo_megatron.rollout.agents.toolkit import ToolKit
from gspo_megatron.rollout.agents.trajectories import AGENT_STATS, TrajectoryRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_trajectories import PARAMS, TEMPLATE, TOKENIZER, engine, model, records  # the agent tests' machinery

DIGIT_SUM = "import:examples.agent_tool.tools:DigitSum"
DOUBLES = "import:gspo_megatron.testing.tool_doubles"
REPO = Path(__file__).resolve().parents[5]


def agent_config(tools: str):
    overrides = ["model=tiny", "task=calculator_add", "rollout.agent.name=tool_calling", f"rollout.agent.tools={tools}"]
    return OmegaConf.to_object(compose(overrides))


def test_a_run_with_a_users_tool_composes_validates_and_its_trajectory_calls_it(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # examples/ is imported from the repository root, as train.py runs
    config = agent_config(f"[calculator,{DIGIT_SUM}]")
    validate_config(config, 1)
    kit = ToolKit(config.rollout.agent)
    assert [spec.name for spec in kit.specs()] == ["calculator", "digitsum"]  # what the model is told

    async def calls_digitsum(ctx: AgentContext) -> None:
        # the model's own turn would be random here: the call is what a model might have written
        ctx.conversation.insert(TOKENIZER.encode(SYMBOL.render(ToolCall("digitsum", {"input": "4096"}))))
        (call,) = ctx.parse(ctx.conversation.output_ids).calls
        ctx.conversation.insert(ctx.template.tool_answers([(call.name, await ctx.call_tool(call))]))
        await ctx.conversation.generate(ctx.turn_params())

    runner = TrajectoryRunner(
        engine(model(1)), calls_digitsum, TEMPLATE, kit.for_record, config.rollout.agent, TOKENIZER.decode
    )
    samples = [s for group in runner.generate(records("4096="), PARAMS) for s in group]
    for sample in samples:  # 4 + 0 + 9 + 6 = 19, the user's tool's answer, inserted into the trajectory
        assert TOKENIZER.decode(sample.output_ids).startswith("<digitsum 4096> 19\n")
        assert sample.extra[AGENT_STATS]["tool_calls"] == 1 and sample.extra[AGENT_STATS]["tool_errors"] == {}


@pytest.mark.parametrize(
    "tools, message",
    [
        (
            "[calculator,import:no_such_package.tools:Weather]",
            r"rollout.agent.tools\[1\]=import:no_such_package.tools:Weather: tool .*cannot import module "
            r"'no_such_package.tools'.*the entry names a class or function that takes no arguments",
        ),
        (
            f"[{DOUBLES}:NoSpec]",
            r"rollout.agent.tools\[0\]=.*:NoSpec built a NoSpec whose spec is NoneType, not a ToolSpec; it must be a "
            r"class or function",
        ),
        (
            f"[{DOUBLES}:NoSchema]",
            r"tools\[0\]=.*:NoSchema: tool 'noschema' has no JSON schema of its arguments \(\"type\" is 'string', not "
            r"\"object\"\); set ToolSpec.parameters",
        ),
        (
            f"[{DOUBLES}:NoTimeout]",
            r"tools\[0\]=.*:NoTimeout: timeout_s=0.0; give the tool a finite timeout_s > 0",
        ),
        (
            f"[{DOUBLES}:fails_to_build]",
            r"tools\[0\]=.*:fails_to_build: building the tool raised RuntimeError: the weather service",
        ),
        (
            f"[calculator,{DOUBLES}:NamedCalculator]",
            r"tools\[1\]=.*:NamedCalculator is a tool named 'calculator', as rollout.agent.tools\[0\]=calculator is; "
            r"rename one",
        ),
        (
            f"[{DIGIT_SUM},{DIGIT_SUM}]",
            r"tools\[1\]=.*:DigitSum is a tool named 'digitsum', as rollout.agent.tools\[0\]=.*:DigitSum is",
        ),
    ],
)
def test_a_wrong_tool_entry_is_refused_at_start_up_naming_its_key_and_the_fix(monkeypatch, tools, message):
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(ConfigError, match=message):
        validate_config(agent_config(tools), 1)


def test_a_wrong_tool_entry_stops_the_run_before_its_directory_is_claimed(tmp_path):
    from gspo_megatron.train import run

    overrides = ["model=tiny", "task=calculator_add", "rollout.agent.name=tool_calling"]
    cfg = compose([*overrides, f"rollout.agent.tools=[{DOUBLES}:NoSpec]"])
    with pytest.raises(ConfigError, match=r"rollout.agent.tools\[0\]"):
        run(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_name_that_is_neither_a_built_in_nor_an_import_path_is_refused_when_composed():
    with pytest.raises(Exception, match=r"tools has \['weather'\].*a user's tool is import:package.module:Name"):
        agent_config("[weather]")
