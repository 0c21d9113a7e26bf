import pytest

from gspo_megatron.core.registry import UnknownNameError
from gspo_megatron.rollout.data import PromptRecord, SymbolTokenizer, TaskConfig, build_task
from gspo_megatron.rollout.rewards import RewardResult, available_rewards, resolve_reward
from gspo_megatron.rollout.rewards.builtin import (
    exact_match,
    last_boxed,
    math_verify,
    position_match,
    split_at_stop,
    think_answer,
)

DIGITS = {"stop_strings": ["<eos>"], "answer_pattern": r"\d+"}


def _digit_record(answer):
    return PromptRecord("max 3817=", answer, dict(DIGITS))


def _r(reward, correct, format_ok):
    return RewardResult(reward=reward, correct=correct, format_ok=format_ok)


def test_split_at_stop_uses_the_earliest_stop_string():
    record = PromptRecord("q", "a", {"stop_strings": ["<|im_end|>", "<|endoftext|>"]})
    assert split_at_stop("x<|endoftext|>y<|im_end|>", record) == ("x", True)
    assert split_at_stop("no stop", record) == ("no stop", False)
    assert split_at_stop("no stop", PromptRecord("q", "a")) == ("no stop", True)  # nothing to look for


@pytest.mark.parametrize(
    "response, expected",
    [
        ("8<eos>", _r(1.0, True, True)),
        (" 8 <eos><pad><pad>", _r(1.0, True, True)),  # whitespace and anything after the stop ignored
        ("7<eos>", _r(0.0, False, True)),
        ("88<eos>", _r(0.0, False, True)),
        ("8", _r(1.0, True, False)),  # right, but never terminated (length limit)
        ("<eos>", _r(0.0, False, False)),  # empty answer
        ("eight<eos>", _r(0.0, False, False)),  # not digits
        ("8 8<eos>8", _r(0.0, False, False)),
    ],
)
def test_exact_match(response, expected):
    assert exact_match(response, _digit_record("8")) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think> step 3 step 8 Wait 8 </think> answer 8<eos>", _r(1.0, True, True)),
        ("<think></think>answer 8<eos>", _r(1.0, True, True)),
        ("<think> step 3 Wait 3 </think> answer 3<eos>", _r(0.0, False, True)),  # wrong, well formed
        ("<think> answer 3 </think> answer 8<eos>", _r(1.0, True, True)),  # answer inside thinking ignored
        ("<think> step 8 </think> 8<eos>", _r(1.0, True, False)),  # no "answer" keyword
        ("answer 8<eos>", _r(1.0, True, False)),  # no thinking block
        ("<think> step 8 answer 8<eos>", _r(0.0, False, False)),  # thinking never closed: no answer
        ("<think> step 8 </think> answer 8", _r(1.0, True, False)),  # not terminated
        ("<think> a </think> answer 8 </think> answer 8<eos>", _r(1.0, True, False)),  # two closings
        ("<think> step 8 </think> answer 8 9<eos>", _r(0.0, False, False)),
    ],
)
def test_think_answer(response, expected):
    assert think_answer(response, _digit_record("8")) == expected


@pytest.mark.parametrize("name", ["max_digit", "sum_mod10", "copy_reverse", "reasoning_max_digit", "running_max"])
def test_task_reference_responses_score_full_marks(name):
    tok = SymbolTokenizer()
    task = build_task(TaskConfig(name=name, max_digits=4), tok)
    reward = resolve_reward(task.reward)
    for record in task.next_batch(20):
        response = tok.decode(tok.encode(record.metadata["reference_response"]) + [tok.eos_token_id])
        assert reward(response, record) == _r(1.0, True, True)
        wrong = str((int(record.answer[0]) + 1) % 10) + record.answer[1:]
        assert reward(response.replace(record.answer + "<eos>", wrong + "<eos>"), record).correct is False


@pytest.mark.parametrize(
    "response, expected",
    [
        ("3888<eos>", _r(1.0, True, True)),
        ("3878<eos>", _r(0.75, False, True)),  # 3 of 4 positions
        ("38<eos>", _r(0.5, False, True)),  # 2 of the 4 the answer has
        ("38889<eos>", _r(0.8, False, True)),  # 4 right of the 5 given
        ("9888<eos>", _r(0.75, False, True)),
        ("3888", _r(1.0, True, False)),  # not terminated: right, but not well-formed
        ("<eos>", _r(0.0, False, False)),
    ],
)
def test_position_match_credits_each_position(response, expected):
    assert position_match(response, _digit_record("3888")) == expected


MATH = {"stop_strings": ["<|im_end|>"]}


@pytest.mark.parametrize(
    "gold, response, expected",
    [
        ("\\frac{1}{2}", "so the answer is \\boxed{0.5}<|im_end|>", _r(1.0, True, True)),
        ("0.5", "\\boxed{\\frac{1}{2}}<|im_end|>", _r(1.0, True, True)),
        ("\\frac{1}{2}", "halving gives 0.5<|im_end|>", _r(1.0, True, False)),  # last number, no box
        ("3", "\\boxed{4}<|im_end|>", _r(0.0, False, True)),
        ("3", "first \\boxed{3}, no wait \\boxed{4}<|im_end|>", _r(0.0, False, True)),  # last box counts
        ("3", "1 + 2 = 3 then 7<|im_end|>", _r(0.0, False, False)),  # last number counts
        ("3", "I do not know<|im_end|>", _r(0.0, False, False)),
        ("3", "\\boxed{3}", _r(1.0, True, False)),  # not terminated
        ("\\sqrt{2}", "\\boxed{\\sqrt{2}}<|im_end|>", _r(1.0, True, True)),
        ("1000", "\\boxed{1,000}<|im_end|>", _r(1.0, True, True)),
    ],
)
def test_math_verify(gold, response, expected):
    assert math_verify(response, PromptRecord("q", gold, dict(MATH))) == expected


def test_last_boxed_handles_nesting_and_unbalanced():
    assert last_boxed("\\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{3} then \\boxed{4") == "3"  # the unbalanced last one is skipped
    assert last_boxed("none") is None


def test_resolve_reward_names_and_imports():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("import:gspo_megatron.rollout.rewards.builtin:think_answer") is think_answer
    assert {"exact_match", "math_verify", "think_answer"} <= set(available_rewards())
    with pytest.raises(UnknownNameError, match=r"exact_match.*import:package.module:function"):
        resolve_reward("exact")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward("import:no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        resolve_reward("import:gspo_megatron.rollout.rewards.builtin:nope")
    with pytest.raises(ValueError, match="must look like"):
        resolve_reward("import:gspo_megatron.rollout.rewards.builtin")


@pytest.mark.parametrize(
    "response, correct, format_ok",
    [
        ("8<eos>", True, True),
        ("3 Wait 8<eos>", True, True),  # the final number counts
        ("8 Wait 3<eos>", False, True),
        ("83<eos>", False, True),  # a different number, not a prefix match
        ("Wait 8", True, False),  # right answer, never terminated
        ("Wait<eos>", False, False),
        ("8<eos>9", True, True),  # text after the stop token is ignored
    ],
)
def test_last_number(response, correct, format_ok):
    from gspo_megatron.rollout.data.records import PromptRecord
    from gspo_megatron.rollout.rewards.registry import resolve_reward

    record = PromptRecord("max 381=", "8", {"stop_strings": ["<eos>"]})
    result = resolve_reward("last_number")(response, record)
    assert (result.correct, result.format_ok, result.reward) == (correct, format_ok, 1.0 if correct else 0.0)
