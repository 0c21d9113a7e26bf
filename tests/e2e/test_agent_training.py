"""Training on multi-turn trajectories (issue 61): every trajectory three turns with two tool answers
inserted (``testing/agents.py``), the embedded engine keeping each trajectory's KV cache between turns.

What the trainer sees equals what the engine produced, token by token: the routing spliced per turn
equals megatron's forward over the whole trajectory on every position (``routing/rollout_vs_train``), the
log-probs of the generated tokens agree to float error (``mismatch/*``: inserted tokens are out of it),
and Routing Replay (R3) consumes the spliced rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gspo_megatron.testing.train_runs import SHORT, read_metrics, run_training

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "rollout" / "data"))
from local_hf_tokenizer import build_local_hf_tokenizer  # a local HF tokenizer with a chat template

pytestmark = pytest.mark.e2e

AGENT = [
    "model=tiny",
    "task=calculator_add",
    "task.min_digits=4",
    "task.max_digits=6",
    "rollout.max_new_tokens=4",
    "rollout.agent.name=import:gspo_megatron.testing.agents:calls_the_calculator_twice",
    "rollout.agent.max_tokens=40",
    *SHORT,
]


@pytest.mark.parametrize("replay", ["none", "rollout"])
def test_multi_turn_trajectories_train_with_the_engines_tokens_and_routing(tmp_path, replay):
    overrides = [*AGENT, f"routing.replay={replay}", "trainer.old_log_probs=trainer"]
    if replay == "rollout":
        overrides.append("algorithm=grpo_rollout_routing_replay")
    result = run_training(overrides, tmp_path / "run")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    for step in metrics:
        assert step["agent/turns_mean"] == 3 and step["agent/tool_calls_mean"] == 2
        assert step["agent/inserted_tokens_mean"] > 0 and step["agent/tool_errors/bad_arguments"] == 0
        assert step["routing/rollout_vs_train_changed_frac"] == 0.0  # every position, every turn
        for turn in range(3):  # and over the positions each turn's engine call fed
            assert step[f"routing/rollout_vs_train_changed_frac/turn_{turn}"] == 0.0
        assert step["mismatch/abs_log_prob_diff_mean"] < 1e-5
    records = [json.loads(line) for line in (tmp_path / "run" / "routing.jsonl").read_text().splitlines()]
    turns = [r for r in records if r["kind"] == "rollout_vs_train" and r["step"] == 1 and "turn" in r]
    whole = [r for r in records if r["kind"] == "rollout_vs_train" and r["step"] == 1 and "turn" not in r]
    # rollout.agent.max_turns=4 turns diagnosed; the fourth fed nothing; the turns' positions add up to the whole
    assert [r["turn"] for r in turns] == [0, 1, 2, 3] and turns[3]["tokens"] == 0
    assert sum(r["tokens"] for r in turns) == whole[0]["tokens"]


@pytest.mark.parametrize("replay", ["none", "rollout"])
def test_trajectories_that_fail_before_their_first_turn_leave_the_step_training(tmp_path, replay):
    # CI 2026-12-06: one client's connection was reset before its first turn, and the step failed ("a sample
    # has none"; the default rollout_vs_train diagnostic asks for the engine's routing). Now such a trajectory
    # is an empty answer (agent/errors); routing replay and the engine comparison cover the others, exactly:
    # the failed ones' prompts, which no engine call fed, are compared with nothing
    overrides = [
        *AGENT,
        "rollout.agent.name=import:gspo_megatron.testing.agents:fails_at_once_on_every_third",
        "trainer.old_log_probs=trainer",
    ]
    if replay == "rollout":
        overrides.append("algorithm=grpo_rollout_routing_replay")
    result = run_training(overrides, tmp_path / "run")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    output = result.stdout + result.stderr
    assert "trajectories ended with an error" in output and "lost its connection" in output
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    for step in metrics:
        assert 0 < step["agent/errors"] < 16  # some failed, the rest ran three turns
        assert step["routing/rollout_vs_train_changed_frac"] == 0.0
        assert step["mismatch/abs_log_prob_diff_mean"] < 1e-5


def test_an_agent_written_against_the_openai_client_drives_a_training_run(tmp_path):
    # testing/agents.py's openai_client_agent: chat completions with tools through the run's session endpoint;
    # two turns per trajectory, the second after the client's own message (a tool answer or a user's)
    build_local_hf_tokenizer(tmp_path / "tokenizer")
    overrides = [
        "model=tiny",
        "model.vocab_size=304",  # the local tokenizer's 300 ids, padded
        "task=calculator_add",
        "tokenizer.kind=hf",
        f"tokenizer.path={tmp_path / 'tokenizer'}",
        "rollout.max_new_tokens=4",
        "rollout.agent.name=openai_endpoint",
        "rollout.agent.client=import:gspo_megatron.testing.agents:openai_client_agent",
        "rollout.agent.max_tokens=60",
        "rollout.agent.trajectory_timeout_s=120",
        *SHORT,
    ]
    result = run_training(overrides, tmp_path / "run")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    for step in metrics:
        assert step["agent/turns_mean"] == 2 and step["agent/errors"] == 0 and step["agent/timeouts"] == 0
        assert step["agent/inserted_tokens_mean"] > 0
        assert step["routing/rollout_vs_train_changed_frac"] == 0.0
        assert step["mismatch/abs_log_prob_diff_mean"] < 1e-5


def test_per_turn_rewards_and_a_users_tool_in_a_training_run(tmp_path):
    # the run validates and builds the user's tool beside the calculator (examples/agent_tool/), the reward reads
    # the turns and returns one reward per turn, and GSPO-token trains on per-turn advantages ([N, S-1])
    overrides = [
        *AGENT,
        "rollout.agent.tools=[calculator,import:examples.agent_tool.tools:DigitSum]",
        "task.reward=import:gspo_megatron.testing.agents:odd_turns",
        "algorithm.loss.name=gspo_token",
        "algorithm.advantage.turn_reward_weight=0.5",
        "trainer.old_log_probs=trainer",
    ]
    result = run_training(overrides, tmp_path / "run")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    for step in metrics:
        assert step["agent/turns_mean"] == 3 and step["agent/turn_rewards_frac"] == 1.0
        assert all(0 <= step[f"agent/turn_reward/turn_{t}"] <= 1 for t in range(3))
        assert step["reward/errors"] == 0 and step["mismatch/abs_log_prob_diff_mean"] < 1e-5


@pytest.mark.parametrize("agent", ["tool_calling", "import:gspo_megatron.testing.agents:looks_up_the_entity"])
def test_the_fact_lookup_task_trains_with_the_lookup_tool_over_its_corpus(tmp_path, agent):
    # +experiment=agent_lookup as docs/agents.md runs it, from a random model: the built-in loop (the model calls
    # when it writes a call), and a test agent that looks the entity up in every trajectory
    overrides = ["+experiment=agent_lookup", f"rollout.agent.name={agent}", "trainer.old_log_probs=trainer", *SHORT]
    result = run_training(overrides, tmp_path / "run")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    for step in metrics:
        assert step["routing/rollout_vs_train_changed_frac"] == 0.0
        assert step["mismatch/abs_log_prob_diff_mean"] < 1e-5 and step["agent/errors"] == 0
        if agent != "tool_calling":  # every trajectory: a turn, the entity's document, a turn
            assert step["agent/turns_mean"] == 2 and step["agent/tool_calls_mean"] == 1
            document = len(" abcd code 1234\n")  # a name, a code: every document's length in symbols
            assert step["agent/tool_used_frac"] == 1.0 and step["agent/inserted_tokens_mean"] == document
            assert sum(step[f"agent/tool_errors/{kind}"] for kind in ("bad_arguments", "unknown_tool", "raised")) == 0
