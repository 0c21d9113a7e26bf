import json

import pytest

from gspo_megatron.core.registry import UnknownNameError
from gspo_megatron.rollout.data import DatasetConfig, SymbolTokenizer, TaskConfig, available_tasks, build_task
from gspo_megatron.rollout.data.tasks import CopyReverseTask, MaxDigitTask, ReasoningMaxDigitTask, SumMod10Task

TOK = SymbolTokenizer()


def _task(name, **overrides):
    return build_task(TaskConfig(name=name, **overrides), TOK)


def test_registry_lists_tasks_and_rejects_unknown():
    assert {"max_digit", "sum_mod10", "copy_reverse", "reasoning_max_digit", "running_max", "jsonl", "parquet"} <= set(
        available_tasks()
    )
    with pytest.raises(UnknownNameError, match="max_digit"):
        _task("max_digits")


@pytest.mark.parametrize(
    "task_cls, digits, prompt, answer",
    [
        (MaxDigitTask, "3817", "max 3817=", "8"),
        (SumMod10Task, "381", "sum 381=", "2"),  # 3+8+1 = 12 -> 2
        (SumMod10Task, "55", "sum 55=", "0"),
        (CopyReverseTask, "3810", "reverse 3810=", "0183"),
        (ReasoningMaxDigitTask, "359", "max 359=", "9"),
    ],
)
def test_problems_by_hand(task_cls, digits, prompt, answer):
    task = task_cls(TaskConfig(name=task_cls.name, max_digits=4), TOK)
    assert task.problem(digits)[:2] == (prompt, answer)


def test_reasoning_reference_scans_with_running_max_and_one_wait():
    task = ReasoningMaxDigitTask(TaskConfig(name="reasoning_max_digit"), TOK)
    _, _, reference = task.problem("3918")
    assert reference == "<think> step 3 step 9 step 9 step 9 Wait 9 </think> answer 9"
    assert TOK.encode(reference).count(TOK.token_id("Wait")) == 1


@pytest.mark.parametrize("name", ["max_digit", "sum_mod10", "copy_reverse", "reasoning_max_digit", "running_max"])
def test_synthetic_stream_is_a_function_of_seed(name):
    a, b = _task(name, seed=7, max_digits=4), _task(name, seed=7, max_digits=4)
    first = a.next_batch(5) + a.next_batch(3)
    assert first == b.next_batch(8)  # batch boundaries do not change the stream
    other = _task(name, seed=8, max_digits=4).next_batch(8)
    assert [r.prompt for r in other] != [r.prompt for r in first]
    evals = a.eval_records(8)
    assert evals == b.eval_records(8) and [r.prompt for r in evals] != [r.prompt for r in first]


def test_synthetic_records_are_consistent_and_short():
    task = _task("max_digit", min_digits=1, max_digits=9)
    for record in task.next_batch(200):
        digits = record.metadata["digits"]
        assert 1 <= len(digits) <= 9
        assert record.answer == max(digits)
        assert record.prompt_ids == tuple(TOK.encode(record.prompt)) and len(record.prompt_ids) <= 12
        assert 1 <= len(TOK.encode(record.answer)) <= 4
        assert record.metadata["stop_strings"] == ["<eos>"]
    lengths = {len(r.metadata["digits"]) for r in task.next_batch(200)}
    assert lengths == set(range(1, 10))  # the configured range is covered, ends included


def test_synthetic_resume():
    task = _task("sum_mod10", seed=3)
    task.next_batch(4)
    state = task.state_dict()
    expected = task.next_batch(4)
    resumed = _task("sum_mod10", seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch(4) == expected
    with pytest.raises(ValueError, match="another task or seed"):
        _task("sum_mod10", seed=4).load_state_dict(state)


def test_synthetic_config_errors():
    with pytest.raises(ValueError, match="at most 4 digits"):
        _task("copy_reverse", max_digits=5)
    with pytest.raises(ValueError, match="at most 9 digits"):
        _task("max_digit", max_digits=10)
    with pytest.raises(ValueError, match="min_digits"):
        _task("max_digit", min_digits=4, max_digits=3)
    with pytest.raises(ValueError, match="eval_seed"):
        _task("max_digit", seed=5, eval_seed=5)


def test_default_rewards_and_override():
    assert _task("max_digit").reward == "exact_match"
    assert _task("reasoning_max_digit").reward == "think_answer"
    assert _task("max_digit", reward="import:my.module:fn").reward == "import:my.module:fn"


def test_jsonl_task_needs_reward_and_serves_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"sum {i}{i}=", "answer": str(2 * i % 10)}) for i in range(5)))
    dataset = DatasetConfig(path=str(path), apply_chat_template=False, shuffle=False)
    with pytest.raises(ValueError, match="task.reward"):
        _task("jsonl", dataset=dataset)
    task = _task("jsonl", dataset=dataset, reward="exact_match")
    assert [r.answer for r in task.next_batch(3)] == ["0", "2", "4"]
    state = task.state_dict()
    resumed = _task("jsonl", dataset=dataset, reward="exact_match")
    resumed.load_state_dict(state)
    assert [r.answer for r in resumed.next_batch(3)] == ["6", "8", "0"]  # wraps into epoch 1
    with pytest.raises(ValueError, match="reads parquet files"):
        _task("parquet", dataset=DatasetConfig(path=str(path), format="jsonl"), reward="exact_match")


def test_running_max_answers_the_largest_digit_so_far():
    task = _task("running_max")
    assert task.problem("3817") == ("max 3817=", "3888", "3888")
    assert task.problem("09") == ("max 09=", "09", "09")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return str(path)


def test_eval_reads_the_eval_dataset_not_the_training_file(tmp_path):
    """Issue 64: evaluation drew the first training records although the docs called it held-out, and no key
    named a validation file. ``task.eval_dataset`` is read like the training file, in file order."""
    train = _jsonl(tmp_path / "train.jsonl", [(f"sum {i}{i}=", "1") for i in range(6)])
    held_out = _jsonl(tmp_path / "val.jsonl", [(f"max {i}{i + 1}=", str(i + 1)) for i in range(4)])
    dataset = DatasetConfig(path=train, apply_chat_template=False, prompt_suffix=" ?")
    task = _task("jsonl", dataset=dataset, reward="exact_match", eval_dataset=held_out)
    evals = task.eval_records(3)
    assert [(r.prompt, r.answer) for r in evals] == [("max 01= ?", "1"), ("max 12= ?", "2"), ("max 23= ?", "3")]
    assert list(evals[0].prompt_ids) == TOK.encode("max 01= ?")  # tokenised like the training prompts
    assert sorted(r.prompt for r in task.next_batch(6)) == [f"sum {i}{i}= ?" for i in range(6)]  # training as before
    assert len(task.eval_records(64)) == 4  # the whole file when it is shorter than trainer.eval_prompts
    without = _task("jsonl", dataset=dataset, reward="exact_match")
    assert [r.prompt for r in without.eval_records(2)] == ["sum 00= ?", "sum 11= ?"]  # today's behaviour


def test_a_missing_eval_dataset_or_one_on_a_synthetic_task_is_refused_naming_the_key(tmp_path):
    dataset = DatasetConfig(path=_jsonl(tmp_path / "t.jsonl", [("sum 1=", "1")]), apply_chat_template=False)
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"task\.eval_dataset='.*nope\.jsonl': dataset file .* does not exist"):
        _task("jsonl", dataset=dataset, reward="exact_match", eval_dataset=missing)
    with pytest.raises(ValueError, match=r"task 'max_digit' draws its held-out prompts from task\.eval_seed"):
        _task("max_digit", eval_dataset=missing)
