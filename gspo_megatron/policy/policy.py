"""The policy: what every rank holds of the model being trained, behind the one object the loop calls.

    policy.old_log_probs(step, batch, micro_batches)  -> OldPolicyResult  (routing recorded or replayed inside)
    policy.reference_log_probs(micro_batches)          -> the KL reference's, per micro-batch (None: no KL)
    policy.update(step, minibatches, totals, clip)     -> UpdateResult     (one optimizer step per mini-batch)
    policy.finish_step(step)                           -> RoutingResult    (the step's routing diagnostics)
    policy.export() / policy.export_own_stage()        -> HF-named tensors, one pass (collective)
    policy.save(...) / policy.load(path)               -> megatron distributed checkpoints

Design decisions:
- Everything routing does in a step -- replay (R2/R3), recordings, diagnostics and their extra passes --
  is ``StepRouting``'s (``policy/routing/step_routing.py``), whose two hooks wrap the old-policy pass
  and each update here; the loop never sees a router.
- pi_old's source (``trainer.old_log_probs``) is resolved once (``build_old_policy_phase``).
- An update's loss denominators are the whole mini-batch's counts (``StepTotals``), so data-parallel
  ranks and micro-batch splits add up to one big batch; the optimizer steps only when the loss and the
  gradients are finite on every rank (``nonfinite.py``).
- The loss's clip fractions are fields of every loss's output (``algorithms/losses.py:ClipSides``); their
  headline sums (``loss/clip_frac_token``, ``loss/clip_frac_seq``) are what adaptive clipping reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gspo_megatron.algorithms.config import OldLogProbSource
from gspo_megatron.algorithms.losses import headline_clip_fractions
from gspo_megatron.algorithms.metrics import SUM, finalize_metrics, merge_metrics
from gspo_megatron.algorithms.reductions import all_reduce_metrics
from gspo_megatron.contracts.batch import RolloutBatch
from gspo_megatron.contracts.micro_batch import StepMicroBatch, UpdateMicroBatch
from gspo_megatron.contracts.phases import ClipFractions, OldPolicyResult, RoutingResult, UpdateResult
from gspo_megatron.contracts.share import StepTotals
from gspo_megatron.core.named_tensors import NamedTensor
from gspo_megatron.policy.checkpoint.check import load_checked_checkpoint
from gspo_megatron.policy.checkpoint.store import save_checkpoint
from gspo_megatron.policy.config import PolicySettings
from gspo_megatron.policy.loss_heads import LogProbHead, PolicyLossHead
from gspo_megatron.policy.models.conversion import export_hf_tensors
from gspo_megatron.policy.models.schedule import run_schedule
from gspo_megatron.policy.nonfinite import NonFiniteError, NonFiniteGuard, parameters_finite
from gspo_megatron.policy.old_policy import build_old_policy_phase
from gspo_megatron.policy.optimizer import keep_configured_hyperparameters, restore_schedule
from gspo_megatron.policy.routing.plan import RoutingPlan
from gspo_megatron.policy.routing.replay import ReplayMode
from gspo_megatron.policy.routing.step_routing import StepRouting

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from gspo_megatron.policy.models.chunks import ModelChunks
    from gspo_megatron.policy.parallel.mesh import ParallelMesh
    from gspo_megatron.policy.reference import ReferenceModel
    from gspo_megatron.policy.routing.replay import RoutingReplay


class Policy:
    def __init__(
        self,
        settings: PolicySettings,
        mesh: ParallelMesh,
        model: ModelChunks,
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        *,
        replay: RoutingReplay | None,
        stage_moe_layers: list[int],
        reference: ReferenceModel | None,
    ) -> None:
        """Built by ``policy/build.py:build_policy``. ``replay``: megatron's routers patched for record and
        replay (None: no MoE layer); ``stage_moe_layers``: this rank's MoE layers, in router build order;
        ``reference``: the frozen KL reference (None unless ``algorithm.kl.coef > 0``)."""
        self.settings, self.mesh, self.model = settings, mesh, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.replay, self.reference = replay, reference
        head = LogProbHead(  # forward-only log-probs at the rollout temperature (old policy, diagnostics' passes)
            mesh.tp_group, settings.temperature, settings.logprob_chunk_size, cp_group=mesh.row_parts_group
        )
        self.old_policy = build_old_policy_phase(settings.old_log_probs, model, mesh, head)
        loss = settings.algorithm.loss
        self.routing = StepRouting(
            routing_plan(settings, has_routers=replay is not None),
            replay,
            model,
            mesh,
            log_prob_head=head,
            stage_moe_layers=stage_moe_layers,
            num_experts=settings.model.num_experts,
            clip=(loss.clip_low, loss.clip_high),
        )
        self.nonfinite = NonFiniteGuard(settings.on_nonfinite, settings.max_consecutive_nonfinite)

    # ------------------------------------------------------------------ the step's phases
    def old_log_probs(self, step: int, batch: RolloutBatch, micro_batches: list[StepMicroBatch]) -> OldPolicyResult:
        """pi_old of this rank's rows: a forward-only pass over exactly the micro-batches the updates use
        (recorded, or R3-replayed), or the engine's log-probs (``trainer.old_log_probs=rollout``)."""
        with self.routing.old_pass(step, micro_batches) as before_forward:
            return self.old_policy.run(batch, micro_batches, before_forward)

    def reference_log_probs(self, micro_batches: Sequence[StepMicroBatch]) -> list[torch.Tensor] | None:
        """The frozen reference's log-probs of every micro-batch (last pipeline stage); None without one."""
        return None if self.reference is None else self.reference.log_probs(micro_batches)

    def update(
        self,
        step: int,
        minibatches: list[list[UpdateMicroBatch]],
        totals: StepTotals,
        clip: tuple[float, float] | None,
    ) -> UpdateResult:
        """One optimizer step per mini-batch (routing replayed when on); ``clip``: this step's adaptive
        (eps_low, eps_high), None for the configured ones.

        With >= 2 updates, ``loss/approx_kl_k3_after_one_update`` is update 1's own KL(pi_old || pi_theta)
        estimate: its forward runs after exactly one optimizer step, on the mini-batch whose routing the
        ``update`` volatility compares (``policy/routing/plan.py``), so the two measure one policy movement
        (``loss/approx_kl_k3`` is the mean over every update, after 0 .. k-1 steps)."""
        merged, after_one_update, grad_norms = None, None, []
        for update, micro_batches in enumerate(minibatches):
            with self.routing.update(update, micro_batches) as before_forward:
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                outputs = run_schedule(
                    self.model,
                    micro_batches,
                    self._loss_head(update, totals, clip),
                    forward_only=False,
                    before_forward=before_forward,
                )
                grad_norms.append(self._guarded_optimizer_step(outputs, f"step {step + 1} update {update}"))
            for out in outputs:
                merged = merge_metrics(merged, out)
                if update == 1:
                    after_one_update = merge_metrics(after_one_update, out)
        metrics = self._reduce_loss_metrics(merged)
        if len(minibatches) > 1:
            metrics["loss/approx_kl_k3_after_one_update"] = self._reduce_loss_metrics(after_one_update)[
                "loss/approx_kl_k3"
            ]
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics.update(self.nonfinite.step_metrics())
        return UpdateResult(metrics, ClipFractions(metrics["loss/clip_frac_token"], metrics["loss/clip_frac_seq"]))

    def finish_step(self, logged_step: int) -> RoutingResult:
        """The step's routing diagnostics, reduced over ranks (collective)."""
        return self.routing.finish(logged_step)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ the weights out
    def export(self) -> Iterator[NamedTensor]:
        """One pass of the policy's HF-named tensors, gathered one at a time (collective on every rank)."""
        return export_hf_tensors(self.model, self.settings.model, self.mesh)

    def export_own_stage(self) -> Iterator[NamedTensor]:
        """This pipeline stage's HF tensors, gathered inside the stage (collective over the stage's ranks)."""
        return export_hf_tensors(self.model, self.settings.model, self.mesh, own_stage_only=True)

    def export_hf(self, out: Path, tokenizer_dir: str | None) -> Path:
        """The policy as a HF checkpoint in ``out`` (collective; replaced atomically)."""
        from gspo_megatron.policy.models.hf_checkpoint import save_hf_checkpoint

        return save_hf_checkpoint(self.model, self.settings.model, self.mesh, out, tokenizer_dir=tokenizer_dir)

    # ------------------------------------------------------------------ checkpoints
    def save(self, run_dir: Path, step: int, state: dict, keep_last: int, run_id: str) -> Path:
        """A distributed checkpoint of weights and optimizer, ``state`` (plain data) beside them; refused
        (on every rank together) when the parameters hold non-finite values."""
        if not parameters_finite(self.model):  # collective
            raise NonFiniteError(
                f"step {step}: the parameters hold non-finite values; refusing to write "
                "a checkpoint (the latest one is untouched)"
            )
        state = {"scheduler": self.scheduler.state_dict(), **state}
        return save_checkpoint(
            run_dir, step, self.model, self.optimizer, state, keep_last, self.mesh.is_driver, run_id=run_id
        )

    def load(self, path: Path) -> dict:
        """Weights, optimizer and LR schedule from checkpoint ``path`` (checked before and after the load:
        non-finite weights are refused); returns its trainer state."""
        with keep_configured_hyperparameters(self.optimizer):  # allowed optimizer changes take effect
            state = load_checked_checkpoint(path, self.model, self.optimizer)
        restore_schedule(self.scheduler, state["scheduler"], print if self.mesh.is_driver else None)
        return state

    def close(self) -> None:
        """megatron's routers get their own methods back, the model can be freed (``ModelChunks.release``),
        and the process groups end."""
        try:
            if self.replay is not None:
                self.replay.restore()
            self.model.release()
        finally:
            self.mesh.destroy()

    # ------------------------------------------------------------------ inside an update
    def _loss_head(self, update: int, totals: StepTotals, clip: tuple[float, float] | None) -> PolicyLossHead:
        """Update ``update``'s loss: denominators are counts of the whole mini-batch, all data-parallel
        ranks' rows; eps is this step's adaptive one, else the configured."""
        settings, mesh = self.settings, self.mesh
        return PolicyLossHead(
            settings.algorithm,
            mesh.tp_group,
            mesh.row_parts_group,
            settings.temperature,
            global_num_sequences=totals.update_sequences[update],
            global_num_tokens=totals.update_tokens[update],
            clip=clip,
            chunk_size=settings.logprob_chunk_size,
        )

    def _guarded_optimizer_step(self, outputs: list[dict], where: str) -> float:
        """Step optimizer and LR schedule only when loss and gradients are finite on every rank."""
        # sums only: empty min/max selections are +-inf by design (algorithms/metrics.py)
        losses = [v for out in outputs for k, v in out.items() if k.endswith(SUM) and torch.is_tensor(v)]
        problem = self.nonfinite.check(losses, self.model)
        grad_norm = float("nan")  # what a skipped update reports
        if problem is None:
            stepped, grad_norm, _ = self.optimizer.step()
            problem = self.nonfinite.after_step(stepped, grad_norm)
            if stepped:
                self.scheduler.step(increment=1)
        if problem is not None and self.mesh.is_driver:
            print(f"[gspo] {where}: {problem}; update skipped (trainer.on_nonfinite={self.nonfinite.policy})")
        self.nonfinite.record(problem, where)
        return float(grad_norm) if problem is None and grad_norm is not None else float("nan")

    def _reduce_loss_metrics(self, merged: dict[str, torch.Tensor] | None) -> dict[str, float]:
        """Sum/min/max over micro-batches (done) and data-parallel ranks, then to every pipeline stage.
        The entries carry their logged names (``PolicyLossHead``)."""
        last_stage: dict[str, float] | None = None
        if merged is not None:
            layout = self.mesh.layout
            # sums are CP-complete already (sequence sums); token min/max also span the CP group
            reduced = (
                merged
                if layout.dp * layout.cp == 1
                else all_reduce_metrics(merged, self.mesh.dp_group, extremum_group=self.mesh.dp_cp_group)
            )
            # a response-length bucket with no response this step is left out (not logged as NaN)
            final = {
                k: float(v)
                for k, v in finalize_metrics(reduced).items()
                if not (k.startswith("loss/ratio_var_") and math.isnan(float(v)))
            }
            final.update(headline_clip_fractions(final, prefix="loss/"))  # the run-dir format's headline
            last_stage = final
        metrics = self.mesh.object_from_last_stage(last_stage)
        if metrics is None:
            raise RuntimeError("the policy update returned no loss metrics (no micro-batch reached the loss)")
        return metrics


def routing_plan(settings: PolicySettings, *, has_routers: bool) -> RoutingPlan:
    """The routing decisions of every step, from the routing section, pi_old's source and the updates."""
    return RoutingPlan(
        ReplayMode(settings.routing.replay),
        engine_old_policy=settings.old_log_probs == OldLogProbSource.rollout,
        updates=settings.updates_per_step,
        has_routers=has_routers,
        diagnostics=settings.routing,
        turns=settings.trajectory_turns,
    )
