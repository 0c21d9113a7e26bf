"""Per-turn rewards (``rollout/agents/turn_rewards.py``): the advantage rule A_i + w * u_{i,t} on the tokens turn
t generated, by hand on a hand-built batch; what reaches GSPO-token's gradient; the reward reading the
trajectory's turns and its per-turn values checked; the per-turn reward metrics; the start-up rules."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gspo_megatron.algorithms.advantages import turn_advantage_terms
from gspo_megatron.algorithms.losses import LossConfig, LossContext, get_policy_loss
from gspo_megatron.config.compose import compose
from gspo_megatron.config.validate import ConfigError, validate_config
from gspo_megatron.contracts.samples import FinishReason, Sample, TurnSpan
from gspo_megatron.rollout.agents.trajectories import AGENT_STATS, trajectory_metrics
from gspo_megatron.rollout.agents.turn_rewards import records_for_reward, token_advantage_terms
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.pack import pack_samples
from gspo_megatron.rollout.rewards.pool import call_reward
from gspo_megatron.rollout.rewards.types import RewardResult

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trajectories import PARAMS, TOKENIZER, engine, model, records, runner, scripted  # the agent tests' own

PROMPT = [5, 6]


def trajectory(turn_lengths: list[int], inserted: int = 1) -> Sample:
    """Turns of the given lengths with ``inserted`` tokens between them (tokens 10.. generated, 40.. inserted)."""
    output, mask, spans = [], [], []
    for t, length in enumerate(turn_lengths):
        if t:
            output += [40 + i for i in range(inserted)]
            mask += [True] * inserted
        spans.append(TurnSpan(len(output), len(output) + length, 1))
        output += [10 + i for i in range(length)]
        mask += [False] * length
    log_probs = torch.where(torch.tensor(mask), 0.0, -0.5)
    return Sample(PROMPT, output, log_probs, FinishReason.STOP, inserted_mask=torch.tensor(mask), turns=spans)


def scored(*turn_rewards) -> list[RewardResult]:
    return [RewardResult(0.0, False, True, turn_rewards=r) for r in turn_rewards]


# one group of four: turn rewards (1, 0), (0,), none, (0, 1); sequence advantages A given
SAMPLES = [trajectory([2, 2]), trajectory([1]), trajectory([1, 1]), trajectory([1, 2])]
SCORED = scored((1.0, 0.0), (0.0,), None, (0.0, 1.0))
A = torch.tensor([0.5, -0.25, -0.25, 0.0])


def test_the_turn_term_is_each_turns_reward_less_its_groups_mean_at_that_turn_by_hand():
    # turn 0: mean(1, 0, 0) = 1/3 over the three that gave rewards; turn 1: mean(0, 1) = 1/2, the two that reached it
    terms = turn_advantage_terms([r.turn_rewards for r in SCORED], group_size=4)
    expected = [[2 / 3, -1 / 2], [-1 / 3], [], [-1 / 3, 1 / 2]]
    for got, want in zip(terms, expected, strict=True):
        assert len(got) == len(want) and all(math.isclose(g, w) for g, w in zip(got, want, strict=True))
    assert turn_advantage_terms([(1.0,), (3.0,)], group_size=1) == [[0.0], [0.0]]  # alone in its group: 0


def test_per_turn_advantages_sit_on_each_turns_generated_tokens_by_hand():
    w = 0.5
    batch = pack_samples(
        SAMPLES,
        A,
        torch.zeros(4),
        torch.zeros(4),
        0,
        token_advantage_terms=token_advantage_terms(SAMPLES, SCORED, 4, w),
    )
    assert batch.advantages.shape == batch.response_mask.shape  # [N, S-1], aligned to the targets
    p = len(PROMPT)
    # row 0: target p-1+k scores output token k: turn 0 (k 0,1), inserted (k 2), turn 1 (k 3,4)
    turn0, turn1 = 0.5 + w * 2 / 3, 0.5 - w * 1 / 2
    expected = {
        0: [turn0, turn0, 0.5, turn1, turn1],
        1: [-0.25 - w / 3],
        2: [-0.25, -0.25, -0.25],  # gave no turn rewards: its sequence advantage on every token
        3: [0.0 - w / 3, 0.0, 0.0 + w / 2, 0.0 + w / 2],
    }
    for row, values in expected.items():
        torch.testing.assert_close(batch.advantages[row, p - 1 : p - 1 + len(values)], torch.tensor(values))
        assert torch.all(batch.advantages[row, : p - 1] == A[row])  # prompt targets: A_i (out of the mask)
    plain = pack_samples(SAMPLES, A, torch.zeros(4), torch.zeros(4), 0)
    assert torch.equal(plain.advantages, A)  # without the weight: one advantage per row, as ever
    zero = pack_samples(
        SAMPLES,
        A,
        torch.zeros(4),
        torch.zeros(4),
        0,
        token_advantage_terms=token_advantage_terms(SAMPLES, SCORED, 4, 0.0),
    )
    mask = zero.response_mask.bool()
    assert torch.equal(zero.advantages[mask], A[:, None].expand_as(mask)[mask])


def test_gspo_token_gives_each_generated_token_the_gradient_of_its_own_turns_advantage():
    w = 0.5
    batch = pack_samples(
        SAMPLES[:1],
        A[:1],
        torch.zeros(1),
        torch.zeros(1),
        0,
        token_advantage_terms=token_advantage_terms(SAMPLES[:1], scored((1.0, -1.0)), 1, w),
    )
    old = batch.rollout_log_probs.clone()
    new = old.clone().requires_grad_(True)  # s = 1: unclipped
    config = LossConfig(name="gspo_token", clip_low=0.2, clip_high=0.3)
    get_policy_loss("gspo_token")(new, old, batch.advantages, batch.response_mask, LossContext(config)).loss.backward()
    # alone in its group, the turn terms are 0: every generated token gets -A/|y| = -0.5/4
    p, generated = len(PROMPT), [0, 1, 3, 4]
    expected = torch.zeros_like(new)
    for k in generated:
        expected[0, p - 1 + k] = -0.5 / len(generated)
    torch.testing.assert_close(new.grad, expected)
    both = pack_samples(
        SAMPLES[:2],
        torch.zeros(2),
        torch.zeros(2),
        torch.zeros(2),
        0,
        token_advantage_terms=token_advantage_terms(SAMPLES[:2], scored((1.0, 0.0), (0.0,)), 2, w),
    )
    old = both.rollout_log_probs.clone()
    new = old.clone().requires_grad_(True)
    get_policy_loss("gspo_token")(new, old, both.advantages, both.response_mask, LossContext(config)).loss.backward()
    # row 0: turn 0's tokens A = w * (1 - 1/2) = 0.25, turn 1's 0 (alone at turn 1); 2 sequences, 4 tokens
    for k, advantage in zip(generated, [0.25, 0.25, 0.0, 0.0], strict=True):
        assert math.isclose(float(new.grad[0, p - 1 + k]), -advantage / 4 / 2, abs_tol=1e-7)
    assert math.isclose(float(new.grad[1, p - 1]), 0.25 / 1 / 2, abs_tol=1e-7)  # row 1: A = w * (0 - 1/2)


def test_the_gspo_loss_refuses_per_token_advantages_naming_gspo_token():
    batch = pack_samples(
        SAMPLES,
        A,
        torch.zeros(4),
        torch.zeros(4),
        0,
        token_advantage_terms=token_advantage_terms(SAMPLES, SCORED, 4, 0.5),
    )
    config = LossConfig(name="gspo", clip_low=0.2, clip_high=0.3)
    with pytest.raises(ValueError, match="use loss 'gspo_token'"):
        get_policy_loss("gspo")(
            batch.rollout_log_probs, batch.rollout_log_probs, batch.advantages, batch.response_mask, LossContext(config)
        )


def turn_lengths(response: str, record: PromptRecord) -> RewardResult:
    """A reward that reads the turns: each turn's reward is its length in symbols."""
    assert record.trajectory is not None
    return RewardResult(1.0, True, True, turn_rewards=tuple(float(len(text)) for text in record.trajectory.turns))


def test_a_reward_reads_the_trajectorys_turns_and_its_per_turn_rewards_are_logged_per_turn_index():
    grouped = runner(engine(model(1)), scripted(["42", "7"])).generate(records("add 3 4:"), PARAMS)
    samples = [s for g in grouped for s in g]
    given = records_for_reward([records("add 3 4:")[0]] * 2, samples, TOKENIZER.decode)
    results = []
    for sample, record in zip(samples, given, strict=True):
        trajectory = record.trajectory
        spans = sample.turns
        assert trajectory.turns == tuple(TOKENIZER.decode(sample.output_ids[s.start : s.end]) for s in spans)
        assert trajectory.inserted[0] == TOKENIZER.decode(sample.output_ids[spans[0].end : spans[1].start])
        assert trajectory.inserted[-1] == ""  # a trajectory ends at its last generated token
        results.append(call_reward(turn_lengths, TOKENIZER.decode(sample.answer_ids), record))
    assert all(r.error is None and len(r.turn_rewards) == 3 for r in results)
    metrics = trajectory_metrics(samples, results)
    for t in range(3):  # the mean over the two trajectories of each turn's length
        lengths = [len(TOKENIZER.decode(s.output_ids[s.turns[t].start : s.turns[t].end])) for s in samples]
        assert math.isclose(float(metrics[f"agent/turn_reward/turn_{t}"]), sum(lengths) / 2, rel_tol=1e-6)
    assert metrics["agent/turn_rewards_frac"] == 1.0 and "agent/turn_reward/turn_3" not in metrics


def test_a_trajectory_that_ended_before_its_first_turn_gives_its_reward_no_turns():
    # e2e: an agent whose client fails before its first turn left a sample with turns == []; its record failed
    # to build ("zip() argument 2 is longer than argument 1") and the run ended
    empty = Sample(
        PROMPT, [], torch.zeros(0), FinishReason.ABORT, inserted_mask=torch.zeros(0, dtype=torch.bool), turns=[]
    )
    (record,) = records_for_reward(records("add:"), [empty], TOKENIZER.decode)
    assert record.trajectory is not None and record.trajectory.turns == () and record.trajectory.inserted == ()
    result = call_reward(lambda response, record: RewardResult(0.0, False, True, turn_rewards=()), "", record)
    assert result.error is None and result.turn_rewards == ()


@pytest.mark.parametrize(
    "turn_rewards, kind, message",
    [
        ((1.0,), "bad_type", "1 values for a trajectory of 2 turns; return one per turn"),
        ("10", "bad_type", "not a sequence"),
        ((1.0, "x"), "bad_type", "return a real number"),
        ((1.0, float("nan")), "nonfinite", "turn_rewards"),
    ],
)
def test_per_turn_rewards_that_do_not_fit_the_trajectory_fail_that_sample(turn_rewards, kind, message):
    record = records_for_reward(records("add:"), [trajectory([1, 1])], TOKENIZER.decode)[0]
    result = call_reward(lambda response, record: RewardResult(1.0, True, True, turn_rewards=turn_rewards), "", record)
    assert result.failure == kind and message in result.error and result.reward == 0.0
    single = call_reward(
        lambda response, record: RewardResult(1.0, True, True, turn_rewards=(1.0,)), "", records("a:")[0]
    )
    assert single.failure == "bad_type" and "per-turn rewards are for multi-turn trajectories" in single.error
    assert call_reward(lambda response, record: 0.5, "", record) == RewardResult(0.5, True, True)  # a plain float


def test_the_step_metrics_count_turns_tool_calls_errors_and_tokens_by_hand():
    samples = [trajectory([2, 2], inserted=3), trajectory([1]), trajectory([1, 1, 1], inserted=2)]
    stats = [(2, {"raised": 1}), (0, {}), (3, {"timeout": 1, "bad_arguments": 2})]
    for sample, (calls, errors) in zip(samples, stats, strict=True):
        sample.extra[AGENT_STATS] = {
            "tool_calls": calls,
            "tool_errors": errors,
            "malformed_calls": 0,
            "timeout": False,
            "error": None,
        }
    metrics = trajectory_metrics(samples, scored((1.0, 3.0), None, (0.0, 2.0, 5.0)))
    assert metrics["agent/turns_mean"] == 2.0  # (2 + 1 + 3) / 3
    assert metrics["agent/tool_calls_mean"] == pytest.approx(5 / 3)
    assert metrics["agent/generated_tokens_mean"] == pytest.approx((4 + 1 + 3) / 3)
    assert metrics["agent/inserted_tokens_mean"] == pytest.approx((3 + 0 + 4) / 3)
    assert metrics["agent/tool_errors/raised"] == 1 and metrics["agent/tool_errors/timeout"] == 1
    assert metrics["agent/tool_errors/bad_arguments"] == 2 and metrics["agent/tool_errors/unknown_tool"] == 0
    assert metrics["agent/turn_reward/turn_0"] == 0.5 and metrics["agent/turn_reward/turn_1"] == 2.5
    assert metrics["agent/turn_reward/turn_2"] == 5.0 and metrics["agent/turn_rewards_frac"] == pytest.approx(2 / 3)


def _typed(*overrides):
    return OmegaConf.to_object(compose(["model=tiny", "task=calculator_add", *overrides]))


def test_per_turn_advantages_are_refused_with_gspo_and_without_an_agent_and_validate_with_gspo_token():
    with pytest.raises(Exception, match=r"turn_reward_weight=0.5 .*algorithm.loss.name=gspo clips one sequence ratio"):
        _typed("rollout.agent.name=tool_calling", "algorithm.advantage.turn_reward_weight=0.5")
    with pytest.raises(ConfigError, match=r"turn_reward_weight=0.5 weighs per-turn rewards.*rollout.agent.name=none"):
        validate_config(_typed("algorithm.loss.name=gspo_token", "algorithm.advantage.turn_reward_weight=0.5"), 1)
    config = _typed(
        "rollout.agent.name=tool_calling",
        "algorithm.loss.name=gspo_token",
        "algorithm.advantage.turn_reward_weight=0.5",
    )
    validate_config(config, 1)
