"""A step's trajectories: ``params.n`` per prompt record, every one an agent coroutine, all in flight at
once over one engine (``batcher.py``), each ending as one ``Sample`` (``conversation.py``).

    runner = TrajectoryRunner(engine, agent, template, tools_for, config, decode)
    grouped = runner.generate(records, params)          # list[list[Sample]]: params.n per record
    outcomes = runner.generate_until(starts, groups, params, needed)   # over-sampling: cut once enough groups end

Design decisions:
- Seeds: trajectory j of a call draws from ``params.seed + j * stride``, each turn from that plus its index
  (``Conversation``), so a resumed run redraws the same trajectories, whatever the batching.
- A trajectory that raises, or runs past ``rollout.agent.trajectory_timeout_s``, ends with what it has
  (counted: ``agent/errors``, ``agent/timeouts``, and logged with the first error); the others and the run go
  on. One that ended before its first turn is an empty answer with no turns (``turns == []``: no engine call
  fed it, so it has no routing rows): no token to train, reward as the verifier scores an empty answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gspo_megatron.contracts.samples import FinishReason, Sample, SamplingParams
from gspo_megatron.rollout.agents.agent import Agent, AgentContext
from gspo_megatron.rollout.agents.batcher import GroupCut, TurnBatcher
from gspo_megatron.rollout.agents.carried import CarriedTrajectory
from gspo_megatron.rollout.agents.conversation import Conversation
from gspo_megatron.rollout.agents.templates import TurnTemplate
from gspo_megatron.rollout.agents.tools.base import TOOL_ERRORS
from gspo_megatron.rollout.agents.tools.runner import ToolRunner
from gspo_megatron.rollout.agents.turn_rewards import turn_reward_metrics
from gspo_megatron.rollout.config import AgentConfig
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.engine import RolloutEngine
from gspo_megatron.rollout.rewards.types import RewardResult

_TRAJECTORY_SEED_STRIDE = 1_000_033
AGENT_STATS = "agent"  # Sample.extra: a trajectory's counts (tool calls, errors by kind, malformed calls)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrajectoryStart:
    """One trajectory to run: its record, its seed, and what an earlier step carried of it (None: fresh)."""

    record: PromptRecord
    seed: int
    carried: CarriedTrajectory | None = None


def trajectory_seed(params: SamplingParams, index: int) -> int:
    """Trajectory ``index`` of a call: ``params.seed + index * stride`` (module docstring)."""
    seed = params.seed if params.seed is not None else 0
    return (seed + _TRAJECTORY_SEED_STRIDE * index) % (2**31 - 1)


class TrajectoryRunner:
    def __init__(
        self,
        engine: RolloutEngine,
        agent: Agent,
        template: TurnTemplate,
        tools_for: Callable[[PromptRecord], ToolRunner],
        config: AgentConfig,
        decode: Callable[[list[int]], str],
        closing: list[Callable[[], None]] | None = None,
    ):
        """``tools_for``: the tools one trajectory of a record may call (a task may bind them to its record);
        ``closing``: what ``close`` stops (the endpoint's server)."""
        self.engine, self.agent, self.template, self.tools_for = engine, agent, template, tools_for
        self.config, self.decode, self.closing = config, decode, list(closing or [])
        self.batch_sizes: list[int] = []  # the engine calls of the last ``generate`` (metrics)

    def generate(self, records: list[PromptRecord], params: SamplingParams) -> list[list[Sample]]:
        """``params.n`` trajectories per record, in record order."""
        batcher = TurnBatcher(self.engine, self.config.max_wait_s)
        starts = [
            TrajectoryStart(record, trajectory_seed(params, index))
            for index, record in enumerate(r for r in records for _ in range(params.n))
        ]
        contexts = [self._context(start, batcher, params) for start in starts]
        outcomes = asyncio.run(batcher.run([self._bounded(context) for context in contexts]))
        self.batch_sizes = batcher.batches
        samples = [self._sample(context, outcome) for context, outcome in zip(contexts, outcomes, strict=True)]
        _log_failures(outcomes, self.config.trajectory_timeout_s)
        return [samples[i * params.n : (i + 1) * params.n] for i in range(len(records))]

    def generate_until(
        self, starts: list[TrajectoryStart], groups: list[int], params: SamplingParams, groups_needed: int
    ) -> list[Sample | CarriedTrajectory | None]:
        """Over-sampling (``agents/partial.py``): each start's trajectory (a carried one continued) until
        ``groups_needed`` groups (``groups[i]``: start i's) have every trajectory ended; then those still
        running are cut (``batcher.GroupCut``). Per start: its ``Sample`` when it ended, else what it carries
        to the next step (None: cut before its first turn, nothing to carry)."""
        batcher = TurnBatcher(self.engine, self.config.max_wait_s)
        contexts = [self._context(start, batcher, params) for start in starts]
        cut = GroupCut(groups, groups_needed)
        outcomes = asyncio.run(batcher.run([self._bounded(context) for context in contexts], cut))
        self.batch_sizes = batcher.batches
        results: list[Sample | CarriedTrajectory | None] = []
        for context, outcome in zip(contexts, outcomes, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                carried = context.conversation.carried()
                results.append(carried if carried.spans else None)
            else:
                results.append(self._sample(context, outcome))
        _log_failures(
            [o for o in outcomes if not isinstance(o, asyncio.CancelledError)], self.config.trajectory_timeout_s
        )
        return results

    def _context(self, start: TrajectoryStart, batcher: TurnBatcher, params: SamplingParams) -> AgentContext:
        record = start.record
        if record.prompt_ids is None:
            raise ValueError(f"the task returned a prompt without token ids: {record.prompt!r}")
        conversation = Conversation(
            list(record.prompt_ids), batcher.generate, start.seed, self.config.max_turns, start.carried
        )
        return AgentContext(
            conversation,
            record,
            self.tools_for(record),
            self.template,
            dataclasses.replace(params, n=1),
            self.config,
            self.decode,
            batcher,
        )

    def close(self) -> None:
        for close in self.closing:
            close()

    def _bounded(self, context: AgentContext):
        async def run() -> None:
            await asyncio.wait_for(self.agent(context), self.config.trajectory_timeout_s)

        return run

    def _sample(self, context: AgentContext, outcome: object) -> Sample:
        conversation = context.conversation
        if not conversation.spans:  # ended before its first turn: an empty answer that no engine call fed
            sample = Sample(
                list(conversation.prompt_ids),
                [],
                torch.zeros(0),
                FinishReason.ABORT,
                weight_version=self.engine.weight_version,
                inserted_mask=torch.zeros(0, dtype=torch.bool),
                turns=[],
            )
        else:
            sample = conversation.sample()
        sample.extra[AGENT_STATS] = {
            "tool_calls": context.tool_calls,
            "tool_errors": dict(context.tool_errors),
            "malformed_calls": context.malformed_calls,
            "rerouted_positions": conversation.rerouted_positions,
            "timeout": isinstance(outcome, TimeoutError),
            "error": None if outcome is None or isinstance(outcome, TimeoutError) else repr(outcome),
        }
        return sample


def trajectory_metrics(samples: list[Sample], scored: list[RewardResult]) -> dict[str, torch.Tensor]:
    """What a step's trajectories did (none for single-turn samples): turns, tool calls and who used a
    tool, errors by kind, generated vs inserted tokens, the reward of trajectories that did and did not use a
    tool, and the per-turn rewards (``turn_rewards.py``)."""
    stats = [s.extra.get(AGENT_STATS) for s in samples]
    if not any(stats):
        return {}
    count = float(len(samples))
    used = torch.tensor([bool(stat and stat["tool_calls"]) for stat in stats])
    rewards = torch.tensor([r.reward for r in scored], dtype=torch.float32)
    inserted = [int(s.inserted_mask.sum()) if s.inserted_mask is not None else 0 for s in samples]
    metrics = {
        "agent/turns_mean": torch.tensor(sum(len(s.turns or ()) for s in samples) / count),
        "agent/tool_calls_mean": torch.tensor(sum(stat["tool_calls"] for stat in stats if stat) / count),
        "agent/tool_used_frac": used.float().mean(),
        "agent/malformed_calls": torch.tensor(float(sum(stat["malformed_calls"] for stat in stats if stat))),
        "agent/rerouted_positions": torch.tensor(
            float(sum(stat.get("rerouted_positions", 0) for stat in stats if stat))
        ),
        "agent/timeouts": torch.tensor(float(sum(bool(stat and stat["timeout"]) for stat in stats))),
        "agent/errors": torch.tensor(float(sum(bool(stat and stat["error"]) for stat in stats))),
        "agent/generated_tokens_mean": torch.tensor(
            sum(len(s.output_ids) - n for s, n in zip(samples, inserted, strict=True)) / count
        ),
        "agent/inserted_tokens_mean": torch.tensor(sum(inserted) / count),
    }
    for kind in TOOL_ERRORS:
        metrics[f"agent/tool_errors/{kind}"] = torch.tensor(
            float(sum(stat["tool_errors"].get(kind, 0) for stat in stats if stat))
        )
    metrics.update(turn_reward_metrics(scored))
    if used.any():
        metrics["agent/reward_with_tool"] = rewards[used].mean()
    if (~used).any():
        metrics["agent/reward_without_tool"] = rewards[~used].mean()
    return metrics


def _log_failures(outcomes: list[object], timeout_s: float) -> None:
    """One warning per call that had failed trajectories: how many, and the first error in full (the metrics
    count them; the log says why)."""
    errors = [outcome for outcome in outcomes if outcome is not None and not isinstance(outcome, TimeoutError)]
    timeouts = sum(isinstance(outcome, TimeoutError) for outcome in outcomes)
    if errors:
        logger.warning(
            "%d of %d trajectories ended with an error (kept with what they had); the first: %r",
            len(errors),
            len(outcomes),
            errors[0],
        )
    if timeouts:
        logger.warning(
            "%d of %d trajectories ran past rollout.agent.trajectory_timeout_s=%s (kept with what they had)",
            timeouts,
            len(outcomes),
            timeout_s,
        )
