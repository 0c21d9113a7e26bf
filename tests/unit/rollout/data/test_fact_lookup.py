"""The fact_lookup task: its world of made-up facts, the corpus the repository ships, and the reward -- the
lookup tool over that corpus answers each record's question, and only the looked-up code scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from local_hf_tokenizer import CHAT_TEMPLATE, build_local_hf_tokenizer

from gspo_megatron.rollout.agents.templates import SymbolTemplate
from gspo_megatron.rollout.agents.tools.base import ToolResult
from gspo_megatron.rollout.agents.tools.corpus import LOOKUP_SPEC, NO_MATCH, CorpusLookup, read_corpus
from gspo_megatron.rollout.data import HFTokenizer, SymbolTokenizer, TaskConfig, build_task
from gspo_megatron.rollout.data.fact_lookup import (
    CORPUS_DIR,
    ENTITIES,
    WARM_START_WORLD,
    Fact,
    corpus_texts,
    world,
    write_corpus,
)
from gspo_megatron.rollout.data.tasks import FactLookupTask
from gspo_megatron.rollout.rewards.registry import resolve_reward

ROOT = Path(__file__).resolve().parents[4]
TOK = SymbolTokenizer()


def _task(**overrides) -> FactLookupTask:
    task = build_task(TaskConfig(name="fact_lookup", **overrides), TOK)
    assert isinstance(task, FactLookupTask)
    return task


def test_a_world_is_a_function_of_its_seed_with_distinct_names():
    facts = world()
    assert facts == world() and len(facts) == ENTITIES == len({f.name for f in facts})
    assert all(len(f.name) == 4 and f.name.isalpha() and len(f.code) == 4 and f.code[0] != "0" for f in facts)
    assert world(5, 3) == world(5, 3) != world(6, 3)
    with pytest.raises(ValueError, match="size=0"):
        world(size=0)


def test_the_warm_starts_world_shares_no_entity_with_the_runs():
    assert not {f.name for f in world()} & {f.name for f in world(WARM_START_WORLD)}


def test_the_shipped_corpus_is_the_worlds():
    # tools/write_fact_corpus.py rewrites it; a change to fact_lookup.world without it fails here
    assert read_corpus(ROOT / CORPUS_DIR) == corpus_texts(world())


def test_write_corpus_replaces_the_documents_it_finds(tmp_path):
    (tmp_path / "stale.txt").write_text("gone")
    (tmp_path / "notes.md").write_text("kept")
    write_corpus(tmp_path, (Fact("abcd", "1234"),))
    assert read_corpus(tmp_path) == {"abcd.txt": "abcd code 1234", "notes.md": "kept"}


def test_the_lookup_answers_every_records_question_and_only_the_looked_up_code_scores():
    lookup = CorpusLookup(ROOT / CORPUS_DIR)
    reward = resolve_reward(_task().reward)
    records = _task(seed=3).next_batch(64)
    assert len({r.metadata["entity"] for r in records}) > 32  # the stream draws across the world
    for record in records:
        name = record.metadata["entity"]
        assert record.prompt == f"code {name}=" and record.prompt_ids == tuple(TOK.encode(record.prompt))
        document = lookup.call({"query": name}).content
        assert document == f"{name} code {record.answer}"
        inserted = TOK.decode(SymbolTemplate(TOK).tool_answers([("lookup", ToolResult(document))]))
        # the reference trajectory: the call, what the agent inserts after it, the code
        assert record.metadata["reference_response"] == f"<lookup {name}>{inserted}{record.answer}"
        assert reward(document.split()[-1] + "<eos>", record).correct
        wrong = "1000" if record.answer != "1000" else "1001"
        assert wrong != record.answer and reward(wrong + "<eos>", record).reward == 0.0
    assert lookup.call({"query": "qqqqq"}).content == NO_MATCH  # a misspelt name finds nothing


def test_the_stream_is_a_function_of_seed_and_resumes():
    a, b = _task(seed=7), _task(seed=7)
    first = a.next_batch(5) + a.next_batch(3)
    assert first == b.next_batch(8)
    assert [r.prompt for r in _task(seed=8).next_batch(8)] != [r.prompt for r in first]
    assert [r.prompt for r in a.eval_records(8)] != [r.prompt for r in first]
    resumed = _task(seed=7)
    resumed.load_state_dict(a.state_dict())
    assert resumed.next_batch(4) == a.next_batch(4)
    with pytest.raises(ValueError, match="another task or seed"):
        _task(seed=8).load_state_dict(a.state_dict())
    assert a.longest_prompt_tokens() == len("code abcd=")


def test_an_eval_dataset_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="task.eval_dataset"):
        _task(eval_dataset="/data/val.jsonl")


# a chat template that tells the model its tools, as Qwen3's does (in its system turn)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function'] | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}" + CHAT_TEMPLATE
)


def test_a_model_with_its_own_tokenizer_is_asked_in_words_with_the_tools_schema(tmp_path):
    build_local_hf_tokenizer(tmp_path, chat_template=TOOLS_TEMPLATE)
    tokenizer = HFTokenizer(tmp_path)
    (record,) = build_task(TaskConfig(name="fact_lookup"), tokenizer).next_batch(1)
    name = record.metadata["entity"]
    system, user = record.prompt.split("<|im_end|>\n", 1)
    assert json.loads(system.removeprefix("<|im_start|>system\n")) == LOOKUP_SPEC.openai()["function"]
    assert user.startswith("<|im_start|>user\nWhat is the code of " + name)
    assert record.prompt.endswith("<|im_start|>assistant\n") and "lookup tool" in record.prompt
    assert record.prompt_ids == tuple(tokenizer.encode(record.prompt))
