"""The rollout side refuses at start-up what its model cannot hold (issue 63): a task whose longest prompt
and the tokens that may follow it pass ``model.max_position_embeddings``, naming the keys and the numbers."""

from __future__ import annotations

import pytest

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config
from gspo_megatron.loop.build import rollout_settings
from gspo_megatron.rollout.build import build_producer, check_positions
from gspo_megatron.rollout.data.tasks import build_task
from gspo_megatron.rollout.data.tokenizer import build_tokenizer


def _task_and_rollout(overrides):
    cfg = to_train_config(compose(overrides))
    tokenizer = build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path, model_vocab_size=cfg.model.vocab_size)
    task = build_task(cfg.task, tokenizer, cfg.prompt_token_budget())
    return task, cfg.rollout


def test_the_synthetic_tasks_longest_prompt_is_the_longest_it_draws():
    task, _ = _task_and_rollout([])
    drawn = max(len(record.prompt_ids or ()) for record in task.next_batch(500) + task.eval_records(500))
    assert task.longest_prompt_tokens() == drawn == 6  # "max " + 3 digits + "=": 6 symbol tokens


def test_positions_past_the_model_are_refused_before_the_first_rollout():
    """The default task's prompts reach 6 tokens, 3 more are generated: 9 positions, the model has 8."""
    cfg = to_train_config(compose(["model.max_position_embeddings=8"]))
    with pytest.raises(
        ValueError,
        match=r"task 'running_max': its longest prompt has 6 tokens and rollout\.max_new_tokens=3 may follow, "
        r"9 positions, more than model\.max_position_embeddings=8; raise model\.max_position_embeddings to at "
        r"least 9",
    ):
        build_producer(rollout_settings(cfg))


def test_an_agents_trajectory_budget_is_what_follows_the_prompt():
    task, rollout = _task_and_rollout(["+experiment=agent_calculator"])
    longest = task.longest_prompt_tokens()
    check_positions(task, rollout, longest + rollout.agent.max_tokens)  # fits exactly
    with pytest.raises(ValueError, match=rf"rollout\.agent\.max_tokens={rollout.agent.max_tokens} may follow"):
        check_positions(task, rollout, longest + rollout.agent.max_tokens - 1)


def test_positions_that_fit_exactly_pass():
    task, rollout = _task_and_rollout([])
    check_positions(task, rollout, 9)
