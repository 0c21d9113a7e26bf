"""Per-turn rewards of multi-turn trajectories: what the reward reads of a trajectory, how a reward's per-turn
values enter the advantages, and their metrics.

A reward may return, beside a trajectory's reward, one reward per generated turn
(``RewardResult.turn_rewards``), reading the turns in ``record.trajectory`` (``TrajectoryText``). The rule:

    A_{i,k} = A_i + w * u_{i,t(k)}        for every token k that turn t(k) of trajectory i generated
    u_{i,t} = r_{i,t} - mean_{j in group(i), j gave turn rewards, T_j > t} r_{j,t}

A_i is the trajectory's advantage as without per-turn rewards (the estimator over the trajectory rewards,
shaping included); w is ``algorithm.advantage.turn_reward_weight`` (0, the default: off, one advantage per
trajectory, the batch exactly as before); u is ``algorithms/advantages.py:turn_advantage_terms``. Inserted
tokens take A_i, and no loss reads them (they are out of the mask).

Design decisions:
- Additive on the sequence advantage, not a replacement: the trajectory's outcome still drives every turn,
  and a per-turn reward says which turns did better than the group's same turn.
- Per-token advantages need a loss that has a term per token: GSPO's sequence ratio s_i is clipped against
  one advantage per trajectory, so ``algorithm.loss.name=gspo`` with w > 0 is refused at start-up; GSPO-token
  keeps s_i's value on every token (the clip still acts on the trajectory's ratio) while each token's gradient
  carries its own turn's advantage (arXiv 2507.18071 sec. 4.3); GRPO has a ratio per token.
- The metrics are logged whatever w is: the mean per-turn reward of each turn index over the trajectories that
  reached it and gave turn rewards (``agent/turn_reward/turn_<t>``), and the fraction of trajectories that gave
  any (``agent/turn_rewards_frac``: a reward that never returns them while w > 0 shows here as 0).
- Dynamic sampling filters groups by their trajectory rewards (and shaping), not by per-turn terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from gspo_megatron.algorithms.advantages import turn_advantage_terms
from gspo_megatron.contracts.samples import Sample
from gspo_megatron.rollout.data.records import PromptRecord, TrajectoryText
from gspo_megatron.rollout.rewards.types import RewardResult


def trajectory_text(sample: Sample, decode: Callable[[list[int]], str]) -> TrajectoryText:
    """Each generated turn's text and the text inserted after it (none after the last: a trajectory ends at its
    last generated token); none of either for a trajectory that ended before its first turn."""
    spans = sample.turns or []
    ends = [span.start for span in spans[1:]] + [len(sample.output_ids)] * bool(spans)
    turns = tuple(decode(sample.output_ids[span.start : span.end]) for span in spans)
    inserted = tuple(decode(sample.output_ids[span.end : end]) for span, end in zip(spans, ends, strict=True))
    return TrajectoryText(turns, inserted)


def records_for_reward(
    records: Sequence[PromptRecord], samples: Sequence[Sample], decode: Callable[[list[int]], str]
) -> list[PromptRecord]:
    """The record each sample's reward gets: a trajectory's with ``trajectory`` set, a single response's as it is."""
    return [
        record if sample.turns is None else dataclasses.replace(record, trajectory=trajectory_text(sample, decode))
        for record, sample in zip(records, samples, strict=True)
    ]


def token_advantage_terms(
    samples: Sequence[Sample], scored: Sequence[RewardResult], group_size: int, weight: float
) -> list[torch.Tensor]:
    """float [len(output_ids)] per sample: w * u_{i,t} on the tokens turn t generated, 0 elsewhere (inserted
    tokens, a single response, a trajectory that gave no turn rewards)."""
    terms = turn_advantage_terms([r.turn_rewards for r in scored], group_size)
    out = []
    for sample, turn_terms in zip(samples, terms, strict=True):
        term = torch.zeros(len(sample.output_ids))
        if turn_terms:  # [] when it gave none; else one per turn (call_reward checked the count)
            for span, value in zip(sample.turns or [], turn_terms, strict=True):
                term[span.start : span.end] = weight * value
        out.append(term)
    return out


def turn_reward_metrics(scored: Sequence[RewardResult]) -> dict[str, torch.Tensor]:
    """The mean reward of each turn index (over the trajectories that reached it and gave turn rewards; none when
    no trajectory gave any), and the fraction of samples that gave any."""
    given = [r.turn_rewards for r in scored if r.turn_rewards is not None]
    metrics = {"agent/turn_rewards_frac": torch.tensor(len(given) / len(scored))} if scored else {}
    longest = max((len(r) for r in given), default=0)
    for turn in range(longest):
        reached = torch.tensor([r[turn] for r in given if len(r) > turn], dtype=torch.float64)
        metrics[f"agent/turn_reward/turn_{turn}"] = reached.mean().float()
    return metrics
