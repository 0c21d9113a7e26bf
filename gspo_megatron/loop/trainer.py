"""The RL trainer: one object that owns model, optimizer, engine, checkpoints and logs.

One step, top to bottom (``train_step``):
    rollout -> reward -> shaped reward -> advantages      (driver rank: ``RolloutPhase``)
    -> each data-parallel rank's rows and micro-batch plan scattered to it (``batch_distribution``)
    -> old log-probs: Megatron forward over the batch, or the engine's   (``old_policy_phase``)
    -> reference log-probs when algorithm.kl.coef > 0      (frozen model; its routers never replay)
    -> k mini-batch policy updates through megatron's schedule and optimizer
    -> weight sync: HF-named export streamed tensor by tensor -> engine.update_weights (loop/weight_sync.py)
    -> metrics, routing diagnostics, evaluation, checkpoint

What a step runs is resolved once from the config: the pi_old source (``build_old_policy_phase``)
and everything routing -- replay mode, recordings, the diagnostics and their passes, R3's targets --
in one ``StepRouting`` (``policy/routing/step_routing.py``), whose two hooks wrap the old-policy phase and
each update; ``train_step`` only calls the phases.

Every rank runs this loop (SPMD); the driver (global rank 0) additionally owns the rollout engine,
the task and the reward pool. Each data-parallel rank receives only the rows of its micro-batches
(its ``RolloutBatch`` holds those rows, ``row_ids``); loss denominators are counts of the whole
mini-batch (``StepTotals``), and sums over rows are reduced over the data-parallel group.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.adaptive_clip import AdaptiveClipController, ClipFractions
from gspo_megatron.algorithms.config import OldLogProbSource
from gspo_megatron.algorithms.metrics import SUM, finalize_metrics, merge_metrics
from gspo_megatron.algorithms.reductions import all_reduce_metrics
from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.contracts.batch import cut_micro_batches, update_batches
from gspo_megatron.contracts.micro_batch import UpdateMicroBatch
from gspo_megatron.contracts.share import RankShare, StepTotals
from gspo_megatron.contracts.token_budget import step_fed_shape
from gspo_megatron.core.provenance import warm_start_record
from gspo_megatron.core.run_dir import ResumeMode, RunDirError, resume_mode
from gspo_megatron.loop.build import Components, evaluation_inputs
from gspo_megatron.loop.corrections import correct_mismatch
from gspo_megatron.loop.distribute import data_parallel_rank_of_each_rank, rank_shares, scatter_shares
from gspo_megatron.loop.weight_sync import sync_engine_weights
from gspo_megatron.policy.checkpoint.check import load_checked_checkpoint
from gspo_megatron.policy.checkpoint.store import latest_checkpoint, save_checkpoint
from gspo_megatron.policy.device_memory import device_memory_peaks
from gspo_megatron.policy.loss_heads import LogProbHead, PolicyLossHead
from gspo_megatron.policy.models.schedule import run_schedule
from gspo_megatron.policy.nonfinite import NonFiniteError, NonFiniteGuard, parameters_finite
from gspo_megatron.policy.old_policy import build_old_policy_phase
from gspo_megatron.policy.optimizer import keep_configured_hyperparameters, restore_schedule
from gspo_megatron.policy.parallel.context_parallel import pad_sequence_length
from gspo_megatron.policy.parallel.heartbeat import is_collective_failure
from gspo_megatron.policy.parallel.layout import sequence_multiple
from gspo_megatron.policy.routing.plan import RoutingPlan
from gspo_megatron.policy.routing.replay import ReplayMode
from gspo_megatron.policy.routing.step_routing import StepRouting
from gspo_megatron.rollout.agents.partial import PartialRollouts
from gspo_megatron.rollout.scheduler import RolloutScheduler
from gspo_megatron.run.run_dir_owner import new_run_id
from gspo_megatron.run.signals import SignalWatch, TrainingInterrupted


class RLTrainer:
    def __init__(self, components: Components, signals: SignalWatch | None = None):
        """``components`` is a ``trainer.setup.Components`` (built by ``trainer.setup.build``);
        ``signals``, if given, is looked at between steps (SIGTERM/SIGINT: save and stop)."""
        self.c = components
        self.signals = signals
        self.cfg = components.cfg
        self.mesh = components.mesh
        self.step = 0
        self.run_id = new_run_id()  # a resumed run takes its checkpoint's id (pruning is per run)
        head = self._log_prob_head()
        self.old_policy = build_old_policy_phase(
            OldLogProbSource(self.cfg.trainer.old_log_probs), components.model, self.mesh, head
        )
        self.routing = self._step_routing(head)  # replay, recordings, diagnostics: two hooks per step
        self.clip_controller = AdaptiveClipController.from_config(self.cfg.algorithm)  # None: fixed eps
        self.rollouts: RolloutScheduler | None = None  # the driver's rollout schedule (synchronous or one step ahead)
        if self.mesh.is_driver:
            rollout, rollout_phase = self.cfg.rollout, components.driver_rollout()
            self.rollouts = RolloutScheduler(
                lambda step: rollout_phase.run(step, self.cfg.trainer.prompts_per_step),
                # bounded by trainer.steps, not stop_after_steps: a job stopped early still prefetches
                # (and checkpoints) the batch the uninterrupted run would train next
                rollout.max_staleness if rollout.async_rollout else 0,
                self.cfg.trainer.steps,
                versions_of=lambda batch: batch.policy_versions.tolist(),
                carried_staleness=rollout.max_staleness if rollout_phase.partial is not None else 0,
            )
        self.placement = components.placement  # rollout.placement: the hand-over between engine and trainer
        self.nonfinite = NonFiniteGuard(self.cfg.trainer.on_nonfinite, self.cfg.trainer.max_consecutive_nonfinite)
        self._dp_rank_of = data_parallel_rank_of_each_rank(self.mesh.dp_rank)  # who gets which rows

    # ------------------------------------------------------------------ main loop
    def train(self) -> str:
        """The run; a failed collective is re-raised naming the silent rank (``policy/parallel/heartbeat.py``)."""
        try:
            return self._train()
        except RuntimeError as error:
            if self.mesh.heartbeat is None or not is_collective_failure(error):
                raise
            raise CollectiveFailure(self.mesh.heartbeat.explain(error, self.mesh.timeout_s)) from error

    def _phase(self, timings: dict, name: str) -> _timed:
        self.mesh.enter(f"step {self.step + 1}, {name}")
        return _timed(timings, name)

    def _train(self) -> str:
        cfg = self.cfg
        self._maybe_resume()
        if self.c.run_log is not None:  # only now: a refused or failed resume leaves config.yaml alone
            self.c.run_log.write_config(
                cpu_threads=torch.get_num_threads(), warm_start=warm_start_record(cfg.model.hf_checkpoint)
            )
        self.sync_weights(version=self.step)
        last = self._last_step()
        while self.step < last:
            metrics = self.train_step()
            self.step += 1
            if self.c.run_log is not None:
                self.c.run_log.log_step(self.step, metrics)
            every = cfg.checkpoint.save_every
            saved = None
            if (every and self.step % every == 0) or self.step == last:
                saved = self.save()
            export_every = cfg.checkpoint.export_hf_every
            if cfg.checkpoint.export_hf and export_every and self.step % export_every == 0 and self.step != last:
                self.export_hf()
            self._stop_if_signalled(saved)
        if cfg.checkpoint.export_hf:
            self.export_hf()
        summary = self.c.run_log.close() if self.c.run_log is not None else ""
        if self.mesh.is_driver:
            from gspo_megatron.run.routing_report import write_routing_report

            write_routing_report(self.c.run_dir, charts=self.cfg.logging.charts)
        return summary

    def _last_step(self) -> int:
        t = self.cfg.trainer
        return t.steps if t.stop_after_steps is None else min(t.steps, t.stop_after_steps)

    def _stop_if_signalled(self, saved: Path | None) -> None:
        """Collective: when any rank got SIGTERM/SIGINT, save (unless just saved) and raise."""
        signum = self.signals.agreed_signal() if self.signals is not None else 0
        if not signum:
            return
        if self.cfg.checkpoint.save_on_signal:
            saved = saved or self.save()
        outcome = signal_stop_outcome(saved, latest_checkpoint(self.c.run_dir))
        raise TrainingInterrupted(signum, f"stopped by {signal.Signals(signum).name} after step {self.step}; {outcome}")

    def train_step(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        with self._phase(timings, "rollout"):
            share = self._rollout()
            self.placement.after_generation()
        batch, totals, metrics = share.batch, share.totals, dict(share.metrics)
        minibatches = cut_micro_batches(batch, share.plan)
        fed = step_fed_shape(minibatches, self.mesh.layout.dp)
        metrics["batch/padded_token_frac"] = fed.padded_fraction(totals.input_tokens)
        metrics.update(fed.metrics())
        flat = [mb for minibatch in minibatches for mb in minibatch]
        with self._phase(timings, "old_logp"), self.routing.old_pass(self.step, flat) as before_forward:
            old = self.old_policy.run(batch, flat, before_forward)
        old_metrics = dict(old.metrics)
        if self.cfg.algorithm.mismatch.active:  # importance weights pi_old / pi_rollout
            mismatch = correct_mismatch(
                batch, old.log_probs, minibatches, self.cfg.algorithm, totals, self.mesh.other_rows_group
            )
            minibatches, totals = mismatch.minibatches, mismatch.totals
            old_metrics.update(mismatch.metrics)
        reference = None
        if self.c.reference is not None:  # algorithm.kl.coef > 0: frozen reference, routers never replay
            with self._phase(timings, "ref_logp"):
                reference = self.c.reference.log_probs(flat)
        updates = update_batches(minibatches, batch, old.log_probs, reference)  # what the loss reads, built once
        with self._phase(timings, "update"):
            update = self._policy_updates(updates, totals)
        with self._phase(timings, "weight_sync"):
            self.sync_weights()
        metrics.update(old_metrics)
        metrics.update(update.metrics)
        metrics.update(self._adapt_clip(update))
        metrics.update(self.routing.finish(self.step + 1))
        eval_every = self.cfg.trainer.eval_every
        if eval_every and (self.step + 1) % eval_every == 0:
            metrics.update(self._evaluate())
        metrics.update(self.placement.metrics())
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        metrics.update(device_memory_peaks(self.mesh.device))
        metrics["lr"] = self.c.optimizer.param_groups[0]["lr"]
        return metrics

    # ------------------------------------------------------------------ phases
    def _adapt_clip(self, update: UpdateResult) -> dict[str, float]:
        """Adaptive clipping (off: no metrics): eps for the next step from this step's clip fraction."""
        if self.clip_controller is None:
            return {}
        clipped = self.clip_controller.measured(update.clip_fractions)
        metrics = self.clip_controller.update(clipped)
        if metrics["clip/held"] and self.mesh.is_driver:
            print(
                f"[gspo] step {self.step + 1}: {self.clip_controller.metric} is {clipped} (no valid token "
                "or a skipped update); adaptive clip held eps for the next step (metric clip/held=1)"
            )
        return metrics

    def _rollout(self) -> RankShare:
        """The driver's rollout, then each data-parallel rank's rows and micro-batch plan to it."""
        shares = None
        if self.rollouts is not None:  # the driver
            batch, metrics = self.rollouts.take(self.step)
            self.rollouts.start_next(self.step + 1)  # async: generates on the current weights meanwhile
            t, layout = self.cfg.trainer, self.mesh.layout
            shares = rank_shares(
                # TP under sequence parallelism and CP split the fed length: pad it to their multiple
                pad_sequence_length(batch, sequence_multiple(layout)),
                metrics,  # train_step copies before adding to it
                dp_size=layout.dp,
                updates=t.updates_per_rollout,
                micro_batch_size=t.micro_batch_size,
                micro_batch_tokens=t.micro_batch_tokens,
                seq_multiple=sequence_multiple(layout),
            )
        return scatter_shares(shares, self._dp_rank_of)

    def _log_prob_head(self) -> LogProbHead:
        """Forward-only log-probs at the rollout temperature (old policy, diagnostics' passes)."""
        cfg, mesh = self.cfg, self.mesh
        return LogProbHead(
            mesh.tp_group,
            cfg.rollout.temperature,
            cfg.trainer.logprob_chunk_size,
            cp_group=mesh.row_parts_group,
        )

    def _step_routing(self, head: LogProbHead) -> StepRouting:
        cfg = self.cfg
        return StepRouting(
            routing_plan(cfg, has_routers=self.c.replay is not None),
            self.c.replay,
            self.c.model,
            self.mesh,
            log_prob_head=head,
            stage_moe_layers=self.c.stage_moe_layers,
            num_experts=cfg.model.num_experts,
            clip=(cfg.algorithm.loss.clip_low, cfg.algorithm.loss.clip_high),
            routing_log=self.c.routing_log,
        )

    def _policy_updates(self, minibatches: list[list[UpdateMicroBatch]], totals: StepTotals) -> UpdateResult:
        merged, grad_norms = None, []
        for update, mbs in enumerate(minibatches):
            with self.routing.update(update, mbs) as before_forward:
                self.c.model.zero_grad_buffer()
                self.c.optimizer.zero_grad()
                outputs = run_schedule(
                    self.c.model,
                    mbs,
                    self._loss_head(update, totals),
                    forward_only=False,
                    before_forward=before_forward,
                )
                grad_norms.append(self._guarded_optimizer_step(outputs, f"step {self.step + 1} update {update}"))
            for out in outputs:
                merged = merge_metrics(merged, out)
        metrics = self._reduce_loss_metrics(merged)
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics.update(self.nonfinite.step_metrics())
        return UpdateResult(metrics, ClipFractions(metrics["loss/clip_frac_token"], metrics["loss/clip_frac_seq"]))

    def _loss_head(self, update: int, totals: StepTotals) -> PolicyLossHead:
        """Update ``update``'s loss: denominators are counts of the whole mini-batch, all data-parallel
        ranks' rows; eps is this step's adaptive one, else the configured."""
        cfg, mesh = self.cfg, self.mesh
        return PolicyLossHead(
            cfg.algorithm,
            mesh.tp_group,
            mesh.row_parts_group,
            cfg.rollout.temperature,
            global_num_sequences=totals.update_sequences[update],
            global_num_tokens=totals.update_tokens[update],
            clip=None if self.clip_controller is None else self.clip_controller.eps,
            chunk_size=cfg.trainer.logprob_chunk_size,
        )

    def _guarded_optimizer_step(self, outputs: list[dict], where: str) -> float:
        """Step optimizer and LR schedule only when loss and gradients are finite on every rank."""
        # sums only: empty min/max selections are +-inf by design (algorithms/metrics.py)
        losses = [v for out in outputs for k, v in out.items() if k.endswith(SUM) and torch.is_tensor(v)]
        problem = self.nonfinite.check(losses, self.c.model)
        grad_norm = float("nan")  # what a skipped update reports
        if problem is None:
            stepped, grad_norm, _ = self.c.optimizer.step()
            problem = self.nonfinite.after_step(stepped, grad_norm)
            if stepped:
                self.c.scheduler.step(increment=1)
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
            for unit in ("token", "seq"):  # the run-dir format's headline clip fractions
                final[f"loss/clip_frac_{unit}"] = (
                    final[f"loss/clip_frac_{unit}_low"] + final[f"loss/clip_frac_{unit}_high"]
                )
            last_stage = final
        metrics = self.mesh.object_from_last_stage(last_stage)
        if metrics is None:
            raise RuntimeError("the policy update returned no loss metrics (no micro-batch reached the loss)")
        return metrics

    def sync_weights(self, version: int | None = None) -> None:
        """Stream the policy's HF-named weights into the rollout engine (collective on all ranks).
        ``version``: optimizer steps trained into the weights (default: after this step's update)."""
        version = self.step + 1 if version is None else version
        self.placement.before_weight_sync()
        if self.rollouts is not None:
            self.rollouts.before_weight_sync()  # an in-flight generation finishes on the old weights
        engine = self.c.engine if self.mesh.is_driver else None
        sync_engine_weights(engine, self.c.model, self.cfg.model, self.mesh, version, self.c.stage_turns)

    def _evaluate(self) -> dict:
        payload: list[Any] = [None]
        if self.mesh.is_driver:
            rollout = self.c.driver_rollout()
            records, params = evaluation_inputs(self.cfg, rollout)
            payload = [rollout.evaluate(records, params)]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        self.mesh.enter(f"step {self.step}, checkpoint save")
        if not parameters_finite(self.c.model):  # collective: every rank refuses together
            raise NonFiniteError(
                f"step {self.step}: the parameters hold non-finite values; refusing to write "
                "a checkpoint (the latest one is untouched)"
            )
        partial = self._partial_rollouts()
        state = {
            "scheduler": self.c.scheduler.state_dict(),
            "task": self.c.driver_task().state_dict() if self.mesh.is_driver else None,
            "config": self.c.config_yaml,
            "clip_controller": self.clip_controller.state_dict() if self.clip_controller else None,
            "rollout_scheduler": self.rollouts.state_dict() if self.rollouts is not None else None,
            "partial_rollouts": partial.state_dict() if partial is not None else None,
        }
        return save_checkpoint(
            self.c.run_dir,
            self.step,
            self.c.model,
            self.c.optimizer,
            state,
            self.cfg.checkpoint.keep_last,
            self.mesh.is_driver,
            run_id=self.run_id,
        )

    def export_hf(self) -> Path:
        """The policy as a HF checkpoint in ``<run>/hf_export/`` (collective; replaced atomically)."""
        from gspo_megatron.policy.models.hf_checkpoint import save_hf_checkpoint

        tokenizer = self.cfg.tokenizer
        out = Path(self.c.run_dir) / "hf_export"
        return save_hf_checkpoint(
            self.c.model,
            self.cfg.model,
            self.mesh,
            out,
            tokenizer_dir=tokenizer.path if tokenizer.kind == "hf" else None,
        )

    def _partial_rollouts(self) -> PartialRollouts | None:
        """The driver's over-sampling state (``rollout.over_sample > 1``), carried groups and all."""
        return self.c.driver_rollout().partial if self.mesh.is_driver else None

    def _maybe_resume(self) -> None:
        mode = resume_mode(self.cfg.checkpoint.resume)
        if mode is ResumeMode.false:
            return
        path = latest_checkpoint(self.c.run_dir)
        if path is None:
            if mode is ResumeMode.true:
                raise RunDirError(f"checkpoint.resume=true but {self.c.run_dir}/checkpoints holds no checkpoint")
            return
        with keep_configured_hyperparameters(self.c.optimizer):  # allowed optimizer changes take effect
            state = load_checked_checkpoint(path, self.c.model, self.c.optimizer)  # NaN weights refused here
        self.run_id = state.get("run_id", "")
        restore_schedule(self.c.scheduler, state["scheduler"], print if self.mesh.is_driver else None)
        if self.mesh.is_driver and state.get("task") is not None:
            self.c.driver_task().load_state_dict(state["task"])
        if self.rollouts is not None and state.get("rollout_scheduler") is not None:
            self.rollouts.load_state_dict(state["rollout_scheduler"])
        partial = self._partial_rollouts()
        if partial is not None and state.get("partial_rollouts") is not None:
            partial.load_state_dict(state["partial_rollouts"])
        self.step = int(state["step"])
        if self.clip_controller is not None and state.get("clip_controller") is not None:
            self.clip_controller.load_state_dict(state["clip_controller"])
        if self.mesh.is_driver:
            lr = self.c.optimizer.param_groups[0]["lr"]
            print(f"[gspo] resumed from {path} at step {self.step}; lr {lr:.6g}")


@dataclass
class UpdateResult:
    """The policy-update phase of one step, on every rank."""

    metrics: dict[str, float]  # logged names: loss/*, entropy, grad_norm, nonfinite/*
    clip_fractions: ClipFractions  # what adaptive clipping steers by


def routing_plan(cfg: TrainConfig, *, has_routers: bool) -> RoutingPlan:
    """The routing decisions of every step, from the config's algorithm, trainer and routing sections."""
    return RoutingPlan(
        ReplayMode(cfg.routing.replay),
        engine_old_policy=cfg.trainer.old_log_probs == OldLogProbSource.rollout,
        updates=cfg.trainer.updates_per_rollout,
        has_routers=has_routers,
        diagnostics=cfg.routing,
    )


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message names the silent rank(s)."""


def signal_stop_outcome(saved: Path | None, latest: Path | None) -> str:
    """What a stop by signal left to resume: this step's checkpoint (saved on the signal or on
    schedule, whatever checkpoint.save_on_signal says), else the latest one, else nothing."""
    if saved is not None:
        return f"checkpoint {saved}; continue with checkpoint.resume=true"
    resumes = f"checkpoint.resume=true continues from {latest}" if latest else "there is no checkpoint to resume"
    return f"no checkpoint written for this step (checkpoint.save_on_signal=false); {resumes}"


class _timed:
    def __init__(self, store: dict, name: str) -> None:
        self.store, self.name = store, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.store[self.name] = time.perf_counter() - self.start
