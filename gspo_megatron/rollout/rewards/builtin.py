"""Built-in reward functions: exact match, think-then-answer, and math-verify.

Design decisions:
- Responses are the decoded completion WITH its stop token text (decode with
  ``skip_special_tokens=False``). Each verifier cuts the text at the first of the record's
  ``metadata["stop_strings"]``; finding none means the sample did not terminate (hit the length
  limit), which fails ``format_ok`` but does not by itself make a right answer wrong. A record
  without ``stop_strings`` treats the whole text as terminated.
- ``reward`` is 1.0 for a correct answer and 0.0 otherwise; format credit is reported in
  ``format_ok`` and left to the shapers (so the base task reward stays a pure accuracy signal).
- ``math_verify`` takes the final answer as the LAST ``\\boxed{...}`` (balanced braces) or, without
  one, the last number in the text; math-verify's parse/verify decide equivalence (``\\frac{1}{2}``
  equals ``0.5``). ``format_ok`` requires the boxed form.
- ``math_verify_boxed`` is Step-GRPO's outcome (arXiv 2604.16890): acc = the last ``\\boxed{...}``
  verifies (no box: wrong; no last-number fallback), fmt = a box exists -- whether or not the
  response terminated. ``shaping.step_grpo.outcome=boxed`` selects it for math tasks.
"""

from __future__ import annotations

import re

from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.rewards.catalog import register_reward
from gspo_megatron.rollout.rewards.types import RewardResult


def split_at_stop(text: str, record: PromptRecord) -> tuple[str, bool]:
    """(text before the first stop string, whether a stop string was found)."""
    stop_strings = [s for s in record.metadata.get("stop_strings", ()) if s]
    if not stop_strings:
        return text, True
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def _answer_shape_ok(answer: str, record: PromptRecord) -> bool:
    pattern = record.metadata.get("answer_pattern")
    return bool(answer) and (pattern is None or re.fullmatch(pattern, answer) is not None)


def _graded(correct: bool, format_ok: bool) -> RewardResult:
    return RewardResult(reward=1.0 if correct else 0.0, correct=correct, format_ok=format_ok)


@register_reward("exact_match", trivial=True)
def exact_match(response: str, record: PromptRecord) -> RewardResult:
    """The whole response before the stop token, stripped, equals the gold answer."""
    body, terminated = split_at_stop(response, record)
    answer = body.strip()
    return _graded(answer == record.answer.strip(), terminated and _answer_shape_ok(answer, record))


@register_reward("position_match", trivial=True)
def position_match(response: str, record: PromptRecord) -> RewardResult:
    """The fraction of the gold answer's characters the response has at the same positions:
    reward = #{i : body[i] == answer[i]} / max(len(body), len(answer)), so a longer or shorter response
    loses what it adds or misses. correct: the whole answer; format_ok: terminated, answer-shaped."""
    body, terminated = split_at_stop(response, record)
    body, answer = body.strip(), record.answer.strip()
    matched = sum(a == b for a, b in zip(body, answer, strict=False))
    reward = matched / max(len(body), len(answer), 1)
    return RewardResult(reward=reward, correct=body == answer, format_ok=terminated and _answer_shape_ok(body, record))


_NO_THINK_TAG = r"(?:(?!</?think>).)"
_THINK_FORMAT = re.compile(rf"\s*<think>{_NO_THINK_TAG}*</think>\s*answer\s*({_NO_THINK_TAG}*?)\s*", re.DOTALL)


def final_answer_after_thinking(body: str) -> str | None:
    """The text after the last "</think>" (and after its last "answer" keyword), stripped.

    None when a thinking block was opened and never closed: such a response gave no final answer.
    """
    if "</think>" in body:
        tail = body.rsplit("</think>", 1)[1]
    elif "<think>" in body:
        return None
    else:
        tail = body
    if "answer" in tail:
        tail = tail.rsplit("answer", 1)[1]
    return tail.strip()


_DIGIT_RUN = re.compile(r"\d+")


@register_reward("last_number", trivial=True)
def last_number(response: str, record: PromptRecord) -> RewardResult:
    """Correct when the last run of digits before the stop token equals the gold answer.

    Free-form responses (e.g. "3 Wait 8<eos>") may reason, hesitate or restate; only the final
    number counts -- the verifiable-answer convention of math RL, in the symbol alphabet. format_ok:
    the response terminated and contains a number.
    """
    body, terminated = split_at_stop(response, record)
    numbers = _DIGIT_RUN.findall(body)
    correct = bool(numbers) and numbers[-1] == record.answer.strip()
    return _graded(correct, terminated and bool(numbers))


@register_reward("think_answer", trivial=True)
def think_answer(response: str, record: PromptRecord) -> RewardResult:
    """Correct when the final answer after the thinking block equals the gold answer.

    format_ok: exactly "<think> ... </think> answer <ans>" (one thinking block), the answer has the
    record's ``answer_pattern``, and the response terminated.
    """
    body, terminated = split_at_stop(response, record)
    answer = final_answer_after_thinking(body)
    correct = answer is not None and answer == record.answer.strip()
    shape = _THINK_FORMAT.fullmatch(body)
    format_ok = terminated and shape is not None and _answer_shape_ok(shape.group(1), record)
    return _graded(correct, format_ok)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth = 0
        for pos in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : pos]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def _parse_math(text: str):
    from math_verify import parse

    return parse(f"${text}$") or parse(text)


def _warm_up_math_verify() -> None:
    from math_verify import parse, verify

    verify(parse("$1$"), parse("$1$"))


@register_reward("math_verify")
def math_verify(response: str, record: PromptRecord) -> RewardResult:
    from math_verify import verify

    body, terminated = split_at_stop(response, record)
    boxed = last_boxed(body)
    if boxed is not None:
        candidate = boxed
    else:
        numbers = _NUMBER.findall(body)
        if not numbers:
            return _graded(False, False)
        candidate = numbers[-1]
    gold = _parse_math(record.answer)
    if not gold:
        return RewardResult.failed(f"math_verify cannot parse the gold answer {record.answer!r}")
    predicted = _parse_math(candidate)
    correct = bool(predicted) and bool(verify(gold, predicted))
    return _graded(correct, terminated and boxed is not None)


math_verify.warm_up = _warm_up_math_verify


@register_reward("math_verify_boxed")
def math_verify_boxed(response: str, record: PromptRecord) -> RewardResult:
    """Step-GRPO's acc/fmt: only a boxed answer is graded; format_ok = a box exists (terminated or not)."""
    from math_verify import verify

    boxed = last_boxed(split_at_stop(response, record)[0])
    if boxed is None:
        return _graded(False, False)
    gold = _parse_math(record.answer)
    if not gold:
        return RewardResult.failed(f"math_verify cannot parse the gold answer {record.answer!r}")
    predicted = _parse_math(boxed)
    return _graded(bool(predicted) and bool(verify(gold, predicted)), True)


math_verify_boxed.warm_up = _warm_up_math_verify
