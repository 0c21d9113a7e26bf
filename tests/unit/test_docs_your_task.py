"""docs/your_task.md's example files (examples/your_task/) build the task its command names: the training
file trains, the validation file is what is evaluated, and the plain-float reward scores through the pool."""

from __future__ import annotations

from pathlib import Path

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config
from gspo_megatron.rollout.data import SymbolTokenizer, build_task
from gspo_megatron.rollout.rewards import RewardConfig, RewardPool, RewardResult

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/your_task"


def test_the_tutorial_task_evaluates_on_its_validation_file_with_a_plain_float_reward(monkeypatch):
    monkeypatch.chdir(ROOT)  # the page's paths and import: name are relative to the repository root
    monkeypatch.syspath_prepend(str(ROOT))
    overrides = [
        "task=jsonl",
        f"task.dataset.path={EXAMPLE}/train.jsonl",
        f"task.eval_dataset={EXAMPLE}/val.jsonl",
        "task.reward=import:examples.your_task.reward:score",
    ]
    config = to_train_config(compose(overrides))
    task = build_task(config.task, SymbolTokenizer())
    evals = task.eval_records(config.trainer.eval_prompts)
    validation = (ROOT / EXAMPLE / "val.jsonl").read_text().splitlines()
    assert len(evals) == len(validation) == 64
    assert [r.metadata["source"] for r in evals[:2]] == [f"{EXAMPLE}/val.jsonl:1", f"{EXAMPLE}/val.jsonl:2"]
    training = {r.prompt for r in task.dataset.records}
    assert not training & {r.prompt for r in evals}  # held out: no validation prompt is trained on
    pool = RewardPool(task.reward, RewardConfig(in_process=True))
    record = evals[0]
    results = pool.score([f"{record.answer}<eos>", "x<eos>"], [record, record])
    assert results == [RewardResult(1.0, True, True), RewardResult(0.0, False, True)]
