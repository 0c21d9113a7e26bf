"""The rollout side, as the loop sees it on the driver: one object, built on the driver only.

    batch, metrics = rollout.take(step)        # this step's batch (generated now, one step ahead, or streamed)
    rollout.load_weights(stream, version)      # the policy's HF-named tensors into the engine
    rollout.evaluate()                         # pass@k on the run's evaluation prompts
    rollout.state_dict() / load_state_dict()   # the task's position, a prefetched batch, carried groups

Inside: the producer (task -> engine, or an agent over it -> rewards -> shaping -> advantages -> pack),
the schedule that decides when it runs (synchronously, one step ahead, or streaming up to k versions ahead), the
engine, the reward pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gspo_megatron.contracts.batch import RolloutBatch
from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.core.named_tensors import NamedTensor
from gspo_megatron.rollout.config import InflightUpdateMode
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.engine import RolloutEngine
from gspo_megatron.rollout.inflight_sync import load_in_flight
from gspo_megatron.rollout.producer import RolloutProducer
from gspo_megatron.rollout.scheduler import RolloutScheduler
from gspo_megatron.rollout.streaming import StreamingScheduler


@dataclass
class Evaluation:
    """The run's evaluation prompts and sampling (``trainer.eval_prompts``, ``trainer.eval_samples`` at
    ``rollout.eval_temperature``, the run's seed, no routed experts)."""

    records: list[PromptRecord]
    params: SamplingParams


class RolloutSide:
    def __init__(
        self,
        producer: RolloutProducer,
        scheduler: RolloutScheduler | StreamingScheduler,
        evaluation: Evaluation,
    ) -> None:
        self.producer, self.scheduler, self.evaluation = producer, scheduler, evaluation

    @property
    def engine(self) -> RolloutEngine:
        return self.producer.engine

    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Step ``step``'s batch and its rollout metrics; in async mode step ``step + 1``'s generation
        starts on the current weights meanwhile."""
        batch, metrics = self.scheduler.take(step)
        self.scheduler.start_next(step + 1)
        return batch, metrics

    def before_weight_sync(self) -> None:
        """An in-flight generation finishes on the weights it started with."""
        self.scheduler.before_weight_sync()

    def load_weights(self, named_tensors: Iterable[NamedTensor], version: int) -> None:
        """Into the engine: between rounds, or (streaming with ``rollout.inflight_update_mode`` on) inside the
        round in flight (``rollout/inflight_sync.py``)."""
        loaded = None
        scheduler = self.scheduler
        try:
            if isinstance(scheduler, StreamingScheduler) and scheduler.inflight_update_mode != InflightUpdateMode.off:
                load_in_flight(
                    self.engine, named_tensors, version, scheduler.inflight_update_mode, scheduler.wait_bound_s
                )
            else:
                self.engine.update_weights(named_tensors, version)
            loaded = version
        finally:
            self.scheduler.after_weight_sync(loaded)  # streaming: the producer goes on, on ``version``

    def evaluate(self) -> dict[str, float]:
        """On the engine between the producer's rounds (streaming: the engine is not generated on by two threads)."""
        with self.scheduler.paused():
            return self.producer.evaluate(self.evaluation.records, self.evaluation.params)

    def state_dict(self) -> dict:
        """What a resumed run needs to draw what the uninterrupted run would: the task's position, a
        batch generated ahead (async), the groups over-sampling carries (``rollout.partial=continue``). Read
        with no generation running, so the task's position and the scheduler's state agree."""
        partial = self.producer.partial
        with self.scheduler.paused():
            return {
                "task": self.producer.task.state_dict(),
                "rollout_scheduler": self.scheduler.state_dict(),
                "partial_rollouts": partial.state_dict() if partial is not None else None,
            }

    def load_state_dict(self, state: dict) -> None:
        if state.get("task") is not None:
            self.producer.task.load_state_dict(state["task"])
        if state.get("rollout_scheduler") is not None:
            self.scheduler.load_state_dict(state["rollout_scheduler"])
        partial = self.producer.partial
        if partial is not None and state.get("partial_rollouts") is not None:
            partial.load_state_dict(state["partial_rollouts"])

    def close(self) -> None:
        """Stop the producer (streaming), the reward workers and the engine (and the servers it launched)."""
        try:
            self.scheduler.close()
            self.producer.rewards.close()
            if self.producer.agent is not None:
                self.producer.agent.close()
        finally:
            self.engine.shutdown()


def batch_versions(batch: RolloutBatch) -> list[int]:
    """The policy version every sample of ``batch`` was generated on (what the staleness bound checks)."""
    if batch.policy_versions is None:
        raise ValueError("a packed rollout batch carries each sample's policy version")
    return [int(v) for v in batch.policy_versions.tolist()]


def batch_response_tokens(batch: RolloutBatch) -> list[int]:
    """Each sample's trained response tokens (what the stale-token metrics count)."""
    return [int(n) for n in batch.response_mask.sum(-1).tolist()]
