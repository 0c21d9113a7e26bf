import math

import pytest
import torch

from gspo_megatron.rollout.shaping import ShapingGroup, StepGRPOConfig
from gspo_megatron.rollout.shaping.segmentation import step_counts
from gspo_megatron.rollout.shaping.step_grpo import step_grpo, step_grpo_rewards

TRIGGERS = ["Wait", "Alternatively"]  # shaping.trigger_words


def make_group(texts, correct, format_ok, triggers=TRIGGERS):
    size = len(texts)
    return ShapingGroup(
        rewards=torch.tensor([float(c) for c in correct]),
        correct=torch.tensor(correct),
        format_ok=torch.tensor(format_ok),
        response_texts=texts,
        steps=step_counts(texts, triggers),
        response_lengths=torch.full((size,), 5, dtype=torch.long),
        max_response_length=16,
    )


def test_hand_computed_group():
    group = make_group(
        ["Let x=2. Wait, check. Answer 4", "Answer 4", "Wait. Alternatively. Wait no. 5", "Waiting... 4"],
        [True, True, False, True],
        [True, True, True, False],
    )
    out = step_grpo(group, StepGRPOConfig())
    # k = [2, 1, 4, 1]; mu over correct {0, 1, 3} = (2 + 1 + 1) / 3 = 4/3
    # R0 = 0.9 * (1 - 0.5 tanh(0.5))   + 0.1 = 0.79204728
    # R1 = 0.9 * (1 - 0.5 tanh(-0.25)) + 0.1 = 1.11021340
    # R2 = incorrect: 0.1 * fmt            = 0.1
    # R3 = 0.9 * (1 - 0.5 tanh(-0.25)) + 0  = 1.01021340  ("Waiting" is not a step)
    assert out.metrics["steps"].tolist() == [2.0, 1.0, 4.0, 1.0]
    assert out.metrics["correct_steps_mean"].item() == pytest.approx(4 / 3)
    torch.testing.assert_close(out.rewards, torch.tensor([0.79204728, 1.11021340, 0.1, 1.01021340]))


def test_two_correct_symmetric_around_mean():
    rewards, mu = step_grpo_rewards(
        torch.tensor([1, 3]), torch.tensor([True, True]), torch.tensor([True, True]), 0.9, 0.5
    )
    # mu = 2: 0.9 (1 -+ 0.5 tanh(-+0.5)) + 0.1
    assert mu.item() == 2.0
    torch.testing.assert_close(rewards, torch.tensor([1.20795272, 0.79204728]))


def test_no_correct_response_gives_format_term_only():
    group = make_group(["Wait a", "b", ""], [False, False, False], [True, False, True])
    out = step_grpo(group, StepGRPOConfig())
    torch.testing.assert_close(out.rewards, torch.tensor([0.1, 0.0, 0.1]))
    assert math.isnan(out.metrics["correct_steps_mean"].item())
    assert torch.isfinite(out.rewards).all()


def test_one_sample_and_equal_steps_get_the_plain_accuracy_reward():
    one = step_grpo(make_group(["Wait Wait"], [True], [True]), StepGRPOConfig())
    torch.testing.assert_close(one.rewards, torch.tensor([1.0]))  # k = mu -> tanh(0) = 0
    equal = step_grpo(
        make_group(["Wait x", "y Alternatively", "Wait"], [True, True, False], [False, True, True]),
        StepGRPOConfig(),
    )
    torch.testing.assert_close(equal.rewards, torch.tensor([0.9, 1.0, 0.1]))


def test_empty_response_counts_one_step():
    out = step_grpo(make_group(["", "Wait, Wait"], [True, True], [True, True]), StepGRPOConfig())
    # k = [1, 3], mu = 2 -> same numbers as the symmetric case.
    torch.testing.assert_close(out.rewards, torch.tensor([1.20795272, 0.79204728]))


def test_custom_triggers_alpha_beta():
    cfg = StepGRPOConfig(alpha=0.5, beta=1.0)
    out = step_grpo(make_group(["Hmm Hmm Wait", "Wait"], [True, True], [True, False], triggers=["Hmm"]), cfg)
    # k = [3, 1], mu = 2: R0 = 0.5 (1 - tanh(0.5)) + 0.5 = 0.76894142; R1 = 0.5 (1 + tanh(0.5)) = 0.73105858
    torch.testing.assert_close(out.rewards, torch.tensor([0.76894142, 0.73105858]))


def test_long_correct_still_beats_incorrect_with_same_format():
    texts = ["x", "Wait " * 50, "y"]
    out = step_grpo(make_group(texts, [True, True, False], [True, True, True]), StepGRPOConfig())
    assert out.rewards[1] > out.rewards[2]
    assert out.rewards[0] > out.rewards[1]


MATH_RECORD = dict(stop_strings=["<|im_end|>"])


def _score(reward_fn, texts, gold="4"):
    from gspo_megatron.rollout.data.records import PromptRecord

    results = [reward_fn(t, PromptRecord("q", gold, dict(MATH_RECORD))) for t in texts]
    return (torch.tensor([r.correct for r in results]), torch.tensor([r.format_ok for r in results]))


def test_boxed_outcome_grades_the_box_and_fmt_is_box_exists_even_when_truncated():
    """Step-GRPO's acc/fmt: a truncated response with a right box scores fully; a right bare number
    does not count (math_verify, the 'verifier' option, accepts it and wants termination for fmt)."""
    from gspo_megatron.rollout.rewards.builtin import math_verify, math_verify_boxed

    texts = [
        "2+2 Wait \\boxed{4}<|im_end|>",  # terminated, boxed, right
        "2+2 gives \\boxed{4} and then I kept going Wait",  # truncated (no stop), boxed, right
        "2+2 = 4<|im_end|>",  # right number, no box
        "2+2 Wait Wait",  # truncated, nothing
    ]
    correct, fmt = _score(math_verify_boxed, texts)
    assert correct.tolist() == [True, True, False, False] and fmt.tolist() == [True, True, False, False]
    v_correct, v_fmt = _score(math_verify, texts)
    assert v_correct.tolist() == [True, True, True, False] and v_fmt.tolist() == [True, False, False, False]
    group = ShapingGroup(
        rewards=correct.float(),
        correct=correct,
        format_ok=fmt,
        response_texts=texts,
        steps=step_counts(texts, TRIGGERS),
        response_lengths=torch.tensor([6, 12, 5, 4]),
        max_response_length=12,
    )
    shaped = step_grpo(group, StepGRPOConfig()).rewards
    # k = [2, 2, 1, 3]; mu = 2 over the two correct: both get alpha * 1 + (1 - alpha) = 1.0
    torch.testing.assert_close(shaped, torch.tensor([1.0, 1.0, 0.0, 0.0]))


def test_boxed_outcome_is_the_default_for_step_grpo_on_math_tasks_only():
    from gspo_megatron.rollout.shaping import ShapingConfig

    assert ShapingConfig(name="step_grpo").reward_name("math_verify") == "math_verify_boxed"
    assert ShapingConfig(name="step_grpo").reward_name("think_answer") == "think_answer"
    verifier = ShapingConfig(name="step_grpo", step_grpo=StepGRPOConfig(outcome="verifier"))
    assert verifier.reward_name("math_verify") == "math_verify"
    assert ShapingConfig(name="grsp").reward_name("math_verify") == "math_verify"
    with pytest.raises(ValueError, match="shaping.step_grpo.outcome"):
        StepGRPOConfig(outcome="box")
