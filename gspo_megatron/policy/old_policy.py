"""The old-policy phase of a step: pi_old log-probs for every row, and the routing they used.

Two phases, chosen once from ``trainer.old_log_probs`` (``build_old_policy_phase``); the trainer
calls ``run`` and never asks which one it holds:

- ``TrainerOldPolicy`` (``trainer``): a forward-only pass of the policy over exactly the
  micro-batches the updates will use (so what it records per micro-batch lines up with the replaying
  forwards), inside the step routing's old-pass context (``policy/routing/step_routing.py``: record; R3:
  replay the engine's, observed), whose ``before_forward`` it is given.
  It also measures the train/inference mismatch and the old policy's entropy.
- ``EngineOldPolicy`` (``rollout``): no forward. The engine reports log_softmax(logits / T) of every
  sampled token (before top-k/top-p filtering, ``rollout/embedded/sampling.py``; SGLang alike,
  ``rollout/sglang/protocol.py``) -- the quantity ``LogProbHead`` would recompute. The GSPO paper
  (arXiv 2507.18071, §4.3) argues the sequence-level ratio tolerates the engine/trainer precision
  gap, so these serve as pi_old directly:

      ratio_i = exp( (1/|y_i|) * sum_t [log pi_theta(y_it) - log pi_engine(y_it)] )

  Consequences: no mismatch metric (it would compare a tensor with itself) and no old entropy; no
  old-policy routing recording (``routing.replay=old_policy`` is refused at start-up,
  ``config/validate.py``; R3 replays the engine's routing and needs none); the routing diagnostics
  take the old policy's routing from the first update's training forward (``policy/routing/plan.py``).

Both return pi_old of this rank's rows (``OldPolicyResult.log_probs``); the trainer builds the updates'
micro-batches from it (``batch.update_batches``) -- neither writes into the batch or the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from gspo_megatron.algorithms.config import OldLogProbSource
from gspo_megatron.algorithms.mismatch_metric import finalize_mismatch, train_inference_mismatch
from gspo_megatron.contracts.batch import RolloutBatch
from gspo_megatron.contracts.micro_batch import StepMicroBatch
from gspo_megatron.contracts.phases import OldPolicyResult
from gspo_megatron.policy.loss_heads import LogProbHead, LogProbOutput
from gspo_megatron.policy.models.schedule import BeforeForward, run_schedule
from gspo_megatron.policy.parallel.mesh import ParallelMesh

if TYPE_CHECKING:
    from gspo_megatron.policy.models.chunks import ModelChunks


class OldPolicyPhase(Protocol):
    def run(
        self, batch: RolloutBatch, micro_batches: list[StepMicroBatch], before_forward: BeforeForward | None
    ) -> OldPolicyResult: ...


class EngineOldPolicy:
    """``trainer.old_log_probs=rollout``: the engine's log-probs are pi_old."""

    def run(
        self, batch: RolloutBatch, micro_batches: list[StepMicroBatch], before_forward: BeforeForward | None
    ) -> OldPolicyResult:
        return OldPolicyResult(batch.rollout_log_probs, {})


class TrainerOldPolicy:
    """``trainer.old_log_probs=trainer``: a forward-only pass of the policy."""

    def __init__(self, model: ModelChunks, mesh: ParallelMesh, head: LogProbHead) -> None:
        self.model, self.mesh, self.head = model, mesh, head

    def run(
        self, batch: RolloutBatch, micro_batches: list[StepMicroBatch], before_forward: BeforeForward | None
    ) -> OldPolicyResult:
        """``before_forward``: the step routing's old-pass hook (record, or R3's replay)."""
        # no autograd graph: a forward-only pass keeps one layer's tensors at a time, not the whole
        # micro-batch's saved activations (as the reference pass, policy/reference.py)
        with torch.no_grad():
            outputs = run_schedule(
                self.model, micro_batches, self.head, forward_only=True, before_forward=before_forward
            )
        old_log_probs = self._gather_rows(outputs, micro_batches, batch, lambda out: out.log_probs)
        mask = batch.mismatch_mask
        sums = train_inference_mismatch(old_log_probs, batch.rollout_log_probs, mask)
        entropy = self._gather_rows(outputs, micro_batches, batch, lambda out: out.entropy)
        sums["entropy_sum"] = (entropy * mask).sum().double()
        sums = self._sum_over_dp(sums)  # data-parallel ranks hold disjoint rows
        metrics = {k: float(v) for k, v in finalize_mismatch(sums).items()}
        metrics["policy/entropy_old"] = float(sums["entropy_sum"] / sums["token_count"].clamp_min(1))
        return OldPolicyResult(old_log_probs, metrics)

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
    head: LogProbHead,
) -> OldPolicyPhase:
    """The phase ``trainer.old_log_probs`` names (the one place that reads it)."""
    phases: dict[OldLogProbSource, OldPolicyPhase] = {
        OldLogProbSource.trainer: TrainerOldPolicy(model, mesh, head),
        OldLogProbSource.rollout: EngineOldPolicy(),
    }
    return phases[source]
