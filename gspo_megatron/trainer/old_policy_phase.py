"""The old-policy phase of a step: pi_old log-probs for every row, and the routing they used.

Two phases, chosen once from ``algorithm.old_log_probs`` (``build_old_policy_phase``); the trainer
calls ``run`` and never asks which one it holds:

- ``TrainerOldPolicy`` (``trainer``): a forward-only pass of the policy over exactly the
  micro-batches the updates will use (so what it records per micro-batch lines up with the replaying
  forwards), under the replay strategy's old-pass routing (record; R3: replay the engine's, observed).
  It also measures the train/inference mismatch and the old policy's entropy.
- ``EngineOldPolicy`` (``rollout``): no forward. The engine reports log_softmax(logits / T) of every
  sampled token (before top-k/top-p filtering, ``rollout/sampling.py``; SGLang alike,
  ``rollout/sglang/protocol.py``) -- the quantity ``LogProbHead`` would recompute. The GSPO paper
  (arXiv 2507.18071, §4.3) argues the sequence-level ratio tolerates the engine/trainer precision
  gap, so these serve as pi_old directly:

      ratio_i = exp( (1/|y_i|) * sum_t [log pi_theta(y_it) - log pi_engine(y_it)] )

  Consequences: no mismatch metric (it would compare a tensor with itself) and no old entropy; no
  old-policy routing recording (``routing_replay=old_policy`` is refused at start-up,
  ``algorithms/config.py``; R3 replays the engine's routing and needs none); the routing diagnostics
  take the old policy's routing from the first update's training forward (``trainer/step_plan.py``).

Both return pi_old of this rank's rows (``OldPolicyResult.log_probs``); the trainer builds the updates'
micro-batches from it (``batch.update_batches``) -- neither writes into the batch or the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from gspo_megatron.algorithms.config import OldLogProbSource
from gspo_megatron.models.schedule import run_schedule
from gspo_megatron.parallel.mesh import ParallelMesh
from gspo_megatron.rollout.mismatch import finalize_mismatch, train_inference_mismatch
from gspo_megatron.routing.recorder import Routing
from gspo_megatron.routing.replay_strategy import ReplayStrategy
from gspo_megatron.trainer.batch import RolloutBatch, StepMicroBatch
from gspo_megatron.trainer.loss_head import LogProbHead, LogProbOutput

if TYPE_CHECKING:
    from gspo_megatron.models.chunks import ModelChunks


@dataclass
class OldPolicyResult:
    log_probs: torch.Tensor  # float [n, S-1]: pi_old of this rank's rows' targets
    metrics: dict[str, float]
    routing: Routing | None = None  # the old policy's routing R2 replays and "update" compares against
    trainer_routing: Routing = field(default_factory=list)  # what the old pass routed with (R3: observed)

    def routing_of(self, first: int, count: int) -> Routing:
        """The old pass's routing of micro-batches ``first .. first + count - 1`` (what R2 replays)."""
        recorded = self.routing or []
        if first + count > len(recorded):
            raise RuntimeError(
                f"old-policy replay needs recorded routing for micro-batches {first}..{first + count - 1} "
                f"but only {len(recorded)} were recorded"
            )
        return recorded[first : first + count]


class OldPolicyPhase(Protocol):
    def run(self, batch: RolloutBatch, micro_batches: list[StepMicroBatch]) -> OldPolicyResult: ...


class EngineOldPolicy:
    """``algorithm.old_log_probs=rollout``: the engine's log-probs are pi_old."""

    def run(self, batch: RolloutBatch, micro_batches: list[StepMicroBatch]) -> OldPolicyResult:
        return OldPolicyResult(batch.rollout_log_probs, {})


class TrainerOldPolicy:
    """``algorithm.old_log_probs=trainer``: a forward-only pass of the policy."""

    def __init__(self, model: ModelChunks, mesh: ParallelMesh, strategy: ReplayStrategy, head: LogProbHead) -> None:
        self.model, self.mesh, self.strategy, self.head = model, mesh, strategy, head

    def run(self, batch: RolloutBatch, micro_batches: list[StepMicroBatch]) -> OldPolicyResult:
        # no autograd graph: a forward-only pass keeps one layer's tensors at a time, not the whole
        # micro-batch's saved activations (as the reference pass, trainer/reference_model.py)
        with self.strategy.old_pass(micro_batches) as recording, torch.no_grad():
            outputs = run_schedule(
                self.model, micro_batches, self.head, forward_only=True, before_forward=recording.before_forward
            )
        old_log_probs = self._gather_rows(outputs, micro_batches, batch, lambda out: out.log_probs)
        mask = batch.mismatch_mask
        sums = train_inference_mismatch(old_log_probs, batch.rollout_log_probs, mask)
        entropy = self._gather_rows(outputs, micro_batches, batch, lambda out: out.entropy)
        sums["entropy_sum"] = (entropy * mask).sum().double()
        sums = self._sum_over_dp(sums)  # data-parallel ranks hold disjoint rows
        metrics = {k: float(v) for k, v in finalize_mismatch(sums).items()}
        metrics["policy/entropy_old"] = float(sums["entropy_sum"] / sums["token_count"].clamp_min(1))
        return OldPolicyResult(old_log_probs, metrics, self.strategy.old_policy_routing(recording), recording.routing)

    def _sum_over_dp(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.mesh.other_rows_group is None:
            return sums
        keys = sorted(sums)
        stacked = self.mesh.sum_over_rows(torch.stack([sums[k].double() for k in keys]))
        return dict(zip(keys, stacked.unbind(), strict=True))

    def _gather_rows(
        self,
        outputs: list[LogProbOutput],
        micro_batches: list[StepMicroBatch],
        batch: RolloutBatch,
        value: Callable[[LogProbOutput], torch.Tensor],
    ) -> torch.Tensor:
        """Per-token values of this rank's rows, from the last stage (one output per micro-batch, in
        order; none on the other stages) to every stage of its pipeline."""
        full = torch.zeros(batch.num_sequences, batch.tokens.shape[1] - 1, device=self.mesh.device)
        for out, mb in zip(outputs, micro_batches if outputs else [], strict=True):
            per_token = value(out)
            full[batch.local(mb.rows).to(full.device), : per_token.shape[1]] = per_token.float()
        return self.mesh.from_last_stage(full).cpu()


def build_old_policy_phase(
    source: OldLogProbSource,
    model: ModelChunks,
    mesh: ParallelMesh,
    strategy: ReplayStrategy,
    head: LogProbHead,
) -> OldPolicyPhase:
    """The phase ``algorithm.old_log_probs`` names (the one place that reads it)."""
    phases: dict[OldLogProbSource, OldPolicyPhase] = {
        OldLogProbSource.trainer: TrainerOldPolicy(model, mesh, strategy, head),
        OldLogProbSource.rollout: EngineOldPolicy(),
    }
    return phases[source]
