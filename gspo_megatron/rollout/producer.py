"""The producer: a step's prompts -> samples -> rewards -> shaped rewards -> advantages -> ``RolloutBatch``.

Runs on the driver rank only (it owns the engine, the task and the reward pool); from the resulting
``RolloutBatch`` each data-parallel rank receives only its rows (``loop/distribute.py``).

Sampling seeds are a pure function of (run seed, step), so a resumed run draws the same samples as
an uninterrupted one without saving any engine state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gspo_megatron.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageOutput
from gspo_megatron.algorithms.config import AlgorithmConfig, make_advantage_context
from gspo_megatron.contracts.batch import RolloutBatch
from gspo_megatron.contracts.samples import Sample, SamplingParams
from gspo_megatron.rollout.agents.partial import PartialRollouts
from gspo_megatron.rollout.agents.trajectories import trajectory_metrics
from gspo_megatron.rollout.agents.turn_rewards import records_for_reward, token_advantage_terms
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.data.tasks import Task
from gspo_megatron.rollout.data.tokenizer import Tokenizer
from gspo_megatron.rollout.dynamic_sampling import collect_informative_groups
from gspo_megatron.rollout.engine import RolloutEngine
from gspo_megatron.rollout.pack import pack_samples
from gspo_megatron.rollout.rewards.pool import RewardPool
from gspo_megatron.rollout.rewards.types import FAILURE_KINDS, RewardResult
from gspo_megatron.rollout.shaping.apply import ShapedBatch, shape_batch, shape_group
from gspo_megatron.rollout.shaping.combine import shaped_advantages
from gspo_megatron.rollout.shaping.config import ShapingCombine, ShapingConfig
from gspo_megatron.rollout.shaping.types import ShapingGroup, group_from_samples

if TYPE_CHECKING:
    from gspo_megatron.rollout.agents.trajectories import TrajectoryRunner


@dataclass
class DrawnGroup:
    """One prompt's responses from a generation round, scored, with their shaping view."""

    samples: list
    scored: list
    shaping: ShapingGroup


class RewardFunctionError(RuntimeError):
    """Every sample's reward call failed: the reward function itself is broken."""


@dataclass
class RolloutProducer:
    engine: RolloutEngine  # evaluation, over-sampling and the weights go to the engine itself
    training_engine: RolloutEngine  # what draws the training rollouts: the engine, or an agent over it (DTR)
    task: Task
    tokenizer: Tokenizer
    rewards: RewardPool
    algorithm: AlgorithmConfig
    shaping: ShapingConfig
    sampling: SamplingParams
    seed: int
    pad_token_id: int
    prompts_per_step: int  # trainer.prompts_per_step: the groups a step trains
    # rollout.truncation.train_on_exit_tokens: the tokens a truncated rollout inserts enter the loss
    train_on_exit_tokens: bool = False
    # rollout.over_sample > 1: start more groups than the step needs, stop once enough are complete
    partial: PartialRollouts | None = None
    # rollout.agent: multi-turn trajectories with tools instead of one response per sample
    agent: TrajectoryRunner | None = None

    def produce(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Step ``step``'s batch and its rollout metrics."""
        prompts_per_step = self.prompts_per_step
        extra_metrics: dict[str, float] = {}
        if self.algorithm.dynamic_sampling.enabled:  # DAPO: only groups with reward variance, more rounds if short
            collected = collect_informative_groups(
                lambda round_index: self._draw(step, round_index, prompts_per_step),
                lambda group: self._has_reward_variance(group, step),
                prompts_per_step,
                self.algorithm.dynamic_sampling.max_extra_rounds,
            )
            drawn, extra_metrics = collected.groups, collected.metrics()
        elif self.partial is not None:
            drawn, extra_metrics = self._draw_partial(step, prompts_per_step)
        else:
            drawn = self._draw(step, 0, prompts_per_step)
        return self.assemble(step, drawn, extra_metrics)

    def draw_round(self, round_index: int) -> list[DrawnGroup]:
        """The streaming mode's round (``rollout/streaming.py``): a step's worth of fresh groups, generated and
        scored, seeded as the synchronous run's step ``round_index``."""
        return self._draw(round_index, 0, self.prompts_per_step)

    def assemble(
        self, step: int, drawn: list[DrawnGroup], extra_metrics: dict[str, float] | None = None
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """The batch step ``step`` trains from its scored groups: shaping at the step's strength, advantages
        within each group, packing; and the step's rollout metrics."""
        samples = [s for group in drawn for s in group.samples]
        scored = [r for group in drawn for r in group.scored]
        rewards = torch.tensor([r.reward for r in scored], dtype=torch.float32)
        g = self.sampling.n
        shaped = shape_batch([group.shaping for group in drawn], self.shaping)
        shaped_rewards = torch.cat([s.rewards for s in shaped.groups]).float()
        shaped_rewards = self._mixed(rewards, shaped_rewards, step)
        estimator = ADVANTAGE_ESTIMATORS.get(self.algorithm.advantage.estimator)
        context = make_advantage_context(self.algorithm.advantage, g)
        advantage = shaped_advantages(rewards, shaped_rewards, lambda r: estimator(r, context), g, self.shaping.combine)
        turn_weight = self.algorithm.advantage.turn_reward_weight
        batch = pack_samples(
            samples,
            advantage.advantages,
            rewards,
            shaped_rewards,
            self.pad_token_id,
            with_routed_experts=self.sampling.return_routed_experts,
            train_on_exit_tokens=self.train_on_exit_tokens,
            # per-turn rewards in the advantages (off by default: one advantage per sample, as ever)
            token_advantage_terms=token_advantage_terms(samples, scored, g, turn_weight) if turn_weight else None,
        )
        metrics = self._metrics(step, samples, scored, shaped, advantage, batch)
        return batch, {**{k: float(v) for k, v in metrics.items()}, **(extra_metrics or {})}

    def _mixed(self, rewards: torch.Tensor, shaped: torch.Tensor, step: int) -> torch.Tensor:
        """The rewards the advantages see: r + strength(step) * (r_shaped - r) (strength ramps shaping in)."""
        return rewards + self.shaping.strength(step) * (shaped - rewards)

    def _has_reward_variance(self, group: DrawnGroup, step: int) -> bool:
        """Whether the rewards the advantages will see (shaping mixed in at this step's strength) differ
        within the group; exact equality, as ``advantage/zero_variance_group_frac`` counts it."""
        rewards = group.shaping.rewards.float()
        shaped = shape_group(group.shaping, self.shaping).rewards.float()
        mixed = self._mixed(rewards, shaped, step)
        if self.shaping.combine == ShapingCombine.advantage:  # A = normalised task reward + centred shaping term
            return _varies(rewards) or _varies(mixed - rewards)
        return _varies(mixed)

    def _draw(self, step: int, round_index: int, prompts: int) -> list[DrawnGroup]:
        """One generation round: ``prompts`` new prompts -> scored groups. Round 0 uses the step's seed;
        extra rounds (dynamic sampling) offset it, so a resumed run redraws exactly the same samples."""
        records = self.task.next_batch(prompts)
        params = _with_seed(self.sampling, self.seed * 1_000_003 + step + round_index * 2**24)
        if self.agent is not None:  # multi-turn trajectories: the agent gets each prompt's record
            return self._scored(records, self.agent.generate(records, params), params)
        return self._scored(records, self.training_engine.generate(_prompt_ids(records), params), params)

    def _draw_partial(self, step: int, prompts: int) -> tuple[list[DrawnGroup], dict[str, float]]:
        """Over-sampling (``rollout/agents/partial.py``): ``prompts`` complete groups, from the carried
        ones and fresh prompts; the seed is the step's, as ``_draw``'s."""
        if self.partial is None:
            raise RuntimeError("_draw_partial without rollout.over_sample")
        params = _with_seed(self.sampling, self.seed * 1_000_003 + step)

        def next_records(count: int) -> list[PromptRecord]:
            records = self.task.next_batch(count)
            _prompt_ids(records)  # every prompt tokenized (a clear error otherwise)
            return records

        version = self.engine.weight_version
        if self.agent is not None:  # trajectories, cut between turns and carried whole (agents/carried.py)
            drawn = self.partial.draw_trajectories(prompts, next_records, self.agent.generate_until, params, version)
        else:
            drawn = self.partial.draw(prompts, next_records, self.engine.generate_rows, params, version)
        records = [group.record for group in drawn.groups]
        return self._scored(records, [group.samples for group in drawn.groups], params), drawn.metrics

    def _scored(
        self, records: list[PromptRecord], grouped: list[list[Sample]], params: SamplingParams
    ) -> list[DrawnGroup]:
        """Each prompt's samples scored by the reward pool, with their shaping view."""
        samples = [s for group in grouped for s in group]
        texts = [self.tokenizer.decode(s.answer_ids) for s in samples]  # a trajectory's last turn
        per_sample = [r for r, g in zip(records, grouped, strict=True) for _ in g]
        if self.agent is not None:  # a trajectory's reward may read its turns (record.trajectory)
            per_sample = records_for_reward(per_sample, samples, self.tokenizer.decode)
        scored = self._score(texts, per_sample)
        rewards = torch.tensor([r.reward for r in scored], dtype=torch.float32)
        correct = torch.tensor([r.correct for r in scored])
        format_ok = torch.tensor([r.format_ok for r in scored])
        g = params.n
        return [
            DrawnGroup(
                samples[i : i + g],
                scored[i : i + g],
                group_from_samples(
                    samples[i : i + g],
                    rewards[i : i + g],
                    correct[i : i + g],
                    format_ok[i : i + g],
                    texts[i : i + g],
                    params.max_new_tokens,
                    self.shaping.trigger_words,
                    self.shaping.trigger_case_sensitive,
                ),
            )
            for i in range(0, len(samples), g)
        ]

    def _metrics(
        self,
        step: int,
        samples: list[Sample],
        scored: list[RewardResult],
        shaped: ShapedBatch,
        advantage: AdvantageOutput,
        batch: RolloutBatch,
    ) -> dict[str, torch.Tensor]:
        rewards, shaped_rewards = batch.rewards, batch.shaped_rewards
        correct = torch.tensor([r.correct for r in scored])
        format_ok = torch.tensor([r.format_ok for r in scored])
        metrics = {
            "reward/mean": rewards.mean(),
            "reward/std": rewards.std() if rewards.numel() > 1 else torch.zeros(()),
            "reward/accuracy": correct.float().mean(),
            "reward/format_ok": format_ok.float().mean(),
            "reward/shaped_mean": shaped_rewards.mean(),
            "reward/shaping_strength": torch.tensor(self.shaping.strength(step)),
            "reward/errors": torch.tensor(float(sum(r.error is not None for r in scored))),
            **{
                f"reward/errors/{kind}": torch.tensor(float(sum(r.failure == kind for r in scored)))
                for kind in FAILURE_KINDS
            },
            "advantage/zero_variance_group_frac": advantage.stats["zero_variance_group_frac"],
            "response/length_mean": batch.response_lengths.float().mean(),
            "response/length_max": batch.response_lengths.float().max(),
            "response/truncated_frac": torch.tensor(
                sum(s.finish_reason.value == "length" for s in samples) / len(samples)
            ),
        }
        servers = {s.extra["server"] for s in samples if s.extra.get("server")}
        if servers:  # SGLang: how many servers made this step's samples (each sample records its own)
            metrics["rollout/servers_used"] = torch.tensor(float(len(servers)))
        for key, value in shaped.metrics.items():
            if value.numel() == 1:
                metrics[f"shaping/{key}"] = value
            elif value.dim() == 1:  # per length cluster (segments_per_cluster): one scalar per cluster
                metrics.update({f"shaping/{key}/{k}": v for k, v in enumerate(value)})
        truncations = [s.truncation for s in samples if s.truncation is not None]
        exit_reasons = [t.exit_reason for t in truncations]
        for reason in sorted(set(exit_reasons), key=str):  # None: a trace that ended without setting one
            metrics[f"truncation/exit_{reason}_frac"] = torch.tensor(exit_reasons.count(reason) / len(samples))
        if exit_reasons:  # inserted (forced) tokens, and how many the loss mask actually leaves out
            metrics["truncation/forced_tokens"] = torch.tensor(float(sum(t.forced_tokens for t in truncations)))
            metrics["truncation/loss_masked_tokens"] = batch.response_lengths.sum() - batch.response_mask.sum()
            metrics["truncation/probes_mean"] = torch.tensor(sum(t.num_probes for t in truncations) / len(samples))
        metrics.update(trajectory_metrics(samples, scored))  # multi-turn trajectories only
        return metrics

    def _score(self, texts: list[str], records: list[PromptRecord]) -> list[RewardResult]:
        scored = self.rewards.score(texts, records)
        errors = [r.error for r in scored if r.error is not None]
        if errors and len(errors) == len(scored):
            raise RewardFunctionError(
                f"the reward function {self.rewards.reward_name!r} failed on all {len(scored)} samples; "
                f"first error: {errors[0]}"
            )
        return scored

    def evaluate(self, records: list[PromptRecord], params: SamplingParams) -> dict[str, float]:
        """pass@1 (first sample), mean@k and pass@k over ``params.n`` samples, and response length. With an
        agent the samples are its trajectories (on the engine itself: no truncated rollout)."""
        if self.agent is not None:
            grouped = self.agent.generate(records, params)
        else:
            grouped = self.engine.generate(_prompt_ids(records), params)
        samples = [s for group in grouped for s in group]
        texts = [self.tokenizer.decode(s.answer_ids) for s in samples]
        per_sample = [r for r, g in zip(records, grouped, strict=True) for _ in g]
        if self.agent is not None:
            per_sample = records_for_reward(per_sample, samples, self.tokenizer.decode)
        scored = self.rewards.score(texts, per_sample)
        k = params.n
        correct = torch.tensor([r.correct for r in scored], dtype=torch.float32).reshape(len(records), k)
        metrics = {
            "eval/pass@1": float(correct[:, 0].mean()),
            "eval/reward_mean": sum(r.reward for r in scored) / len(scored),
            "eval/response_length": sum(len(s.output_ids) for s in samples) / len(samples),
        }
        if k > 1:
            metrics[f"eval/mean@{k}"] = float(correct.mean())
            metrics[f"eval/pass@{k}"] = float(correct.amax(dim=1).mean())
        return metrics


def _varies(values: torch.Tensor) -> bool:
    return bool(values.max() > values.min())


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed % (2**31 - 1))


def _prompt_ids(records: list[PromptRecord]) -> list[list[int]]:
    """The token ids of each prompt (tasks tokenize their prompts when they draw them)."""
    missing = [r.prompt for r in records if r.prompt_ids is None]
    if missing:
        raise ValueError(f"the task returned prompts without token ids, e.g. {missing[0]!r}")
    return [list(r.prompt_ids or ()) for r in records]
