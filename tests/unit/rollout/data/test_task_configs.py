"""conf/task/*.yaml compose against TaskConfig and build working tasks; jsonl_math end to end."""

import json
from pathlib import Path

import pytest
from local_hf_tokenizer import build_local_hf_tokenizer
from omegaconf import OmegaConf

from gspo_megatron.rollout.data import HFTokenizer, SymbolTokenizer, TaskConfig, build_task
from gspo_megatron.rollout.rewards import RewardConfig, RewardPool

CONF = Path(__file__).resolve().parents[4] / "gspo_megatron" / "conf" / "task"


def _compose(name, **overrides) -> TaskConfig:
    """The task section of ``conf/task/NAME.yaml`` (a ``_global_`` file: its ``task:`` node; the rest are the
    job settings the task brings, composed by tests/unit/config)."""
    loaded = OmegaConf.load(CONF / f"{name}.yaml")
    merged = OmegaConf.merge(OmegaConf.structured(TaskConfig), loaded.task, overrides)
    return OmegaConf.to_object(merged)


def test_every_task_yaml_composes_and_names_its_command():
    names = sorted(p.stem for p in CONF.glob("*.yaml"))
    assert {"max_digit", "reasoning_max_digit", "jsonl_math"} <= set(names)
    for name in names:
        header = f"# @package _global_\n# python -m gspo_megatron.train task={name}"
        assert (CONF / f"{name}.yaml").read_text().startswith(header)
        assert isinstance(_compose(name), TaskConfig)


def test_unknown_key_fails_at_compose_time():
    with pytest.raises(Exception, match="max_digitz"):
        OmegaConf.merge(OmegaConf.structured(TaskConfig), {"max_digitz": 3})


@pytest.mark.parametrize("name, reward", [("max_digit", "exact_match"), ("reasoning_max_digit", "think_answer")])
def test_synthetic_yamls_build(name, reward):
    task = build_task(_compose(name), SymbolTokenizer())
    assert task.reward == reward and len(task.next_batch(4)) == 4


def test_jsonl_math_end_to_end(tmp_path):
    build_local_hf_tokenizer(tmp_path / "tok")
    tokenizer = HFTokenizer(tmp_path / "tok")
    data = tmp_path / "train.jsonl"
    data.write_text(
        json.dumps({"prompt": "what is 1 + 2 ?", "answer": "3"})
        + "\n"
        + json.dumps({"prompt": "half of 1 ?", "answer": "\\frac{1}{2}"})
        + "\n"
    )
    config = _compose("jsonl_math", dataset={"path": str(data), "shuffle": False})
    task = build_task(config, tokenizer)
    first, second = task.next_batch(2)
    assert first.prompt.startswith("<|im_start|>user\nwhat is 1 + 2 ?\nPlease reason step by step")
    assert first.prompt.endswith("<|im_start|>assistant\n") and list(first.prompt_ids) == tokenizer.encode(first.prompt)
    assert first.metadata["stop_strings"] == ["<|im_end|>", "<|endoftext|>"]

    responses = ["1 + 2 = \\boxed{3}<|im_end|>", "so it is 0.5<|endoftext|>"]
    with RewardPool(task.reward, RewardConfig(num_workers=1, timeout_s=30.0)) as pool:
        results = pool.score(responses, [first, second])
    assert [(r.reward, r.correct, r.format_ok, r.error) for r in results] == [
        (1.0, True, True, None),
        (1.0, True, False, None),  # right (0.5 == 1/2) but not boxed
    ]


def test_jsonl_math_with_the_symbol_tokenizer_is_refused_naming_the_suffix_and_the_fix(tmp_path):
    """Issue 64: ``task=jsonl_math`` with the default tokenizer failed on its own prompt suffix with
    "SymbolTokenizer cannot encode character 'P'" at line 1 of the user's file, naming no key to change."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "sum 12=", "answer": "3"}) + "\n")
    config = _compose("jsonl_math", dataset={"path": str(data)})
    fix = r"task\.dataset\.prompt_suffix cannot be encoded: .*'P'.*tokenizer\.kind=hf tokenizer\.path=.*suffix=''"
    with pytest.raises(ValueError, match=fix):
        build_task(config, SymbolTokenizer())
    system = _compose("jsonl_math", dataset={"path": str(data), "prompt_suffix": "", "system_prompt": "Be brief"})
    with pytest.raises(ValueError, match=r"task\.dataset\.system_prompt cannot be encoded: .*'B'.*system_prompt=null"):
        build_task(system, SymbolTokenizer())
    plain = build_task(_compose("jsonl_math", dataset={"path": str(data), "prompt_suffix": ""}), SymbolTokenizer())
    assert plain.next_batch(1)[0].prompt == "sum 12="  # prompts in the symbol alphabet still train
