"""The RL trainer: one object that owns model, optimizer, engine, checkpoints and logs.

One step, top to bottom (``train_step``):
    rollout -> reward -> shaped reward -> advantages      (driver rank: ``RolloutPhase``)
    -> broadcast the batch to every rank
    -> old log-probs: Megatron forward over the batch      (routing recorded / replayed if on)
    -> k mini-batch policy updates through megatron's schedule and optimizer
    -> weight sync: streamed HF-named export -> engine.update_weights
    -> metrics, routing diagnostics, evaluation, checkpoint

Every rank runs this loop (SPMD); the driver (global rank 0) additionally owns the rollout engine,
the task and the reward pool. All ranks see the same ``RolloutBatch``; each data-parallel rank works
on its slice of every mini-batch, and loss denominators are counts of the whole mini-batch.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.metrics import finalize_metrics, merge_metrics
from gspo_megatron.algorithms.reductions import all_reduce_metrics
from gspo_megatron.models.conversion import export_hf_weights
from gspo_megatron.models.schedule import run_schedule
from gspo_megatron.rollout.mismatch import finalize_mismatch, train_inference_mismatch
from gspo_megatron.trainer.batch import RolloutBatch, partition
from gspo_megatron.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gspo_megatron.trainer.diagnostics import RoutingDiagnostics
from gspo_megatron.trainer.engine_old_log_probs import use_engine_log_probs
from gspo_megatron.trainer.loss_head import LogProbHead, PolicyLossHead
from gspo_megatron.trainer.micro_batches import sequence_multiple, step_padded_fraction


class RLTrainer:
    def __init__(self, components):
        """``components`` is a ``trainer.setup.Components`` (built by ``trainer.setup.build``)."""
        self.c = components
        self.cfg = components.cfg
        self.mesh = components.mesh
        self.step = 0
        self.diagnostics = RoutingDiagnostics(self.cfg.routing, components, self.mesh)

    # ------------------------------------------------------------------ main loop
    def train(self) -> str:
        cfg = self.cfg
        self._maybe_resume()
        self.sync_weights()
        last = cfg.trainer.steps if cfg.trainer.stop_after_steps is None else min(cfg.trainer.steps, cfg.trainer.stop_after_steps)
        while self.step < last:
            metrics = self.train_step()
            self.step += 1
            if self.c.run_log is not None:
                self.c.run_log.log_step(self.step, metrics)
            every = cfg.checkpoint.save_every
            if (every and self.step % every == 0) or self.step == last:
                self.save()
            export_every = cfg.checkpoint.export_hf_every
            if cfg.checkpoint.export_hf and export_every and self.step % export_every == 0 and self.step != last:
                self.export_hf()
        if cfg.checkpoint.export_hf:
            self.export_hf()
        summary = self.c.run_log.close() if self.c.run_log is not None else ""
        if self.mesh.is_driver:
            from gspo_megatron.routing.report import write_routing_report

            write_routing_report(self.c.run_dir)
        return summary

    def train_step(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        with _timed(timings, "rollout"):
            batch, metrics = self._rollout()
        t, layout = self.cfg.trainer, self.mesh.layout
        parts = partition(batch, t.updates_per_rollout, t.micro_batch_size, layout.dp, self.mesh.dp_rank,
                          t.micro_batch_tokens, sequence_multiple(layout))
        metrics["batch/padded_token_frac"] = step_padded_fraction(batch, parts, layout.dp)
        with _timed(timings, "old_logp"):
            old_metrics = self._old_log_probs(batch, parts)
        with _timed(timings, "update"):
            update_metrics = self._policy_updates(batch, parts)
        with _timed(timings, "weight_sync"):
            self.sync_weights()
        metrics.update(old_metrics)
        metrics.update(update_metrics)
        metrics.update(self.diagnostics.finish_step(self.step + 1))
        eval_every = self.cfg.trainer.eval_every
        if eval_every and (self.step + 1) % eval_every == 0:
            metrics.update(self._evaluate())
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        metrics["lr"] = self.c.optimizer.param_groups[0]["lr"]
        return metrics

    # ------------------------------------------------------------------ phases
    def _rollout(self) -> tuple[RolloutBatch, dict]:
        payload = [None]
        if self.mesh.is_driver:
            payload = [self.c.rollout.run(self.step, self.cfg.trainer.prompts_per_step)]
        dist.broadcast_object_list(payload, src=0)
        batch, metrics = payload[0]
        return batch, dict(metrics)

    def _old_log_probs(self, batch: RolloutBatch, parts: list[list[dict]]) -> dict:
        """pi_old log-probs (and the routing they used) for every row, on every rank.

        Runs over exactly the micro-batches the updates will use (``parts``, flattened), so what it
        records per micro-batch lines up with the replaying forwards; it adds ``old_log_probs`` to
        each of those micro-batches.
        """
        cfg, mesh, replay = self.cfg, self.mesh, self.c.replay
        mode = cfg.algorithm.routing_replay
        flat = [mb for part in parts for mb in part]
        if cfg.algorithm.old_log_probs == "rollout":
            self.diagnostics.remember_old_routing(None, flat)
            return use_engine_log_probs(batch, flat)
        head = LogProbHead(mesh.tp_group, cfg.rollout.temperature, cfg.algorithm.logprob_chunk_size)
        before = None
        if replay is not None:
            if mode == "rollout":
                replay.load_targets([self._rollout_targets(mb) for mb in flat])
                before = replay.before_forward
            else:
                replay.start_recording()
        outputs = run_schedule(self.c.model, flat, head, forward_only=True, before_forward=before)
        if replay is not None:
            if mode == "rollout":
                replay.assert_fully_consumed()
                recorded = None
            else:
                recorded = replay.recorded()
            replay.stop()
            self.diagnostics.remember_old_routing(recorded, flat)
            self.diagnostics.rollout_vs_train(self.step, flat, self._rollout_targets)
        batch.old_log_probs = self._gather_rows(outputs, flat, "log_probs", batch)
        mask = batch.response_mask
        sums = train_inference_mismatch(batch.old_log_probs, batch.rollout_log_probs, mask)
        out = {k: float(v) for k, v in finalize_mismatch(sums).items()}
        entropy = self._gather_rows(outputs, flat, "entropy", batch)
        out["policy/entropy_old"] = float((entropy * mask).sum() / mask.sum().clamp_min(1))
        # the update micro-batches carry the old log-probs from here on
        for mb in flat:
            mb["old_log_probs"] = batch.old_log_probs[mb["rows"], : mb["tokens"].shape[1]]
        return out

    def _gather_rows(self, outputs: list[dict], flat: list[dict], key: str, batch: RolloutBatch) -> torch.Tensor:
        """Per-token values of this rank's rows (last stage) -> the whole batch on every rank."""
        full = torch.zeros(batch.num_sequences, batch.tokens.shape[1] - 1, device=self.mesh.device)
        for out in outputs:
            full[out["rows"].to(full.device), : out[key].shape[1]] = out[key].float()
        # data-parallel ranks hold disjoint rows: a sum assembles them
        if self.mesh.layout.dp > 1 and self.mesh.is_last_stage:
            dist.all_reduce(full, group=self.mesh.dp_group)
        if self.mesh.layout.pp > 1:
            dist.broadcast(full, src=self.mesh.last_stage_global_rank, group=self.mesh.pp_group)
        return full.cpu()

    def _rollout_targets(self, micro_batch: dict) -> list[torch.Tensor]:
        from gspo_megatron.routing.replay import rollout_targets

        return rollout_targets(
            micro_batch["routed_experts"], self.c.stage_moe_layers, self.mesh.tp_rank,
            self.mesh.layout.tp, self.mesh.layout.use_sequence_parallel,
        )

    def _policy_updates(self, batch: RolloutBatch, parts: list[list[dict]]) -> dict:
        cfg, mesh = self.cfg, self.mesh
        per_update = batch.num_sequences // cfg.trainer.updates_per_rollout
        merged = None
        grad_norms = []
        offset = 0
        for update, mbs in enumerate(parts):
            mask = batch.response_mask[update * per_update : (update + 1) * per_update]
            head = PolicyLossHead(
                cfg.algorithm, mesh.tp_group, None if mesh.layout.cp == 1 else mesh.cp_group,
                cfg.rollout.temperature,
                global_num_sequences=(mask.sum(1) > 0).sum().float(),
                global_num_tokens=mask.sum(),
            )
            before = self._replay_for_update(offset, mbs)
            record = self.diagnostics.records_training_forward(update, self.step)
            if record:
                self.c.replay.start_recording()
            self.c.ddp.zero_grad_buffer()
            self.c.optimizer.zero_grad()
            outputs = run_schedule(self.c.model, mbs, head, forward_only=False, before_forward=before)
            if record:
                self.diagnostics.from_training_forward(self.c.replay.recorded(), offset, mbs,
                                                        self._rollout_targets, self.step)
            if self.c.replay is not None:
                self.c.replay.assert_fully_consumed()
                self.c.replay.stop()
            ok, grad_norm, _ = self.c.optimizer.step()
            if not ok:
                raise FloatingPointError(f"optimizer step {self.step}/{update} was skipped (non-finite gradients)")
            self.c.scheduler.step(increment=1)
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            for out in outputs:
                merged = merge_metrics(merged, {k: v for k, v in out.items() if "/" in k})
            self.diagnostics.after_update(update, self.step, parts[0])
            offset += len(mbs)
        metrics = self._reduce_loss_metrics(merged)
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return metrics

    def _replay_for_update(self, offset: int, mbs: list[dict]):
        replay = self.c.replay
        mode = self.cfg.algorithm.routing_replay
        if replay is None or mode == "none":
            return None
        if mode == "rollout":
            replay.load_targets([self._rollout_targets(mb) for mb in mbs])
        else:
            replay.load_targets(self.diagnostics.old_routing_for(offset, len(mbs)))
        return replay.before_forward

    def _reduce_loss_metrics(self, merged: Optional[dict]) -> dict:
        """Sum/min/max over micro-batches (done) and data-parallel ranks, then to the driver."""
        payload = [None]
        if merged is not None:
            reduced = all_reduce_metrics(merged, self.mesh.dp_group) if self.mesh.layout.dp > 1 else merged
            final = {f"loss/{k}" if not k.startswith(("loss/", "entropy")) else k: float(v)
                     for k, v in finalize_metrics(reduced).items()}
            for unit in ("token", "seq"):  # the run-dir format's headline clip fractions
                final[f"loss/clip_frac_{unit}"] = final[f"loss/clip_frac_{unit}_low"] + final[f"loss/clip_frac_{unit}_high"]
            payload = [final]
        if self.mesh.layout.pp > 1:
            dist.broadcast_object_list(payload, src=self.mesh.last_stage_global_rank, group=self.mesh.pp_group)
        return payload[0] or {}

    def sync_weights(self) -> None:
        """Stream the policy's HF-named weights into the rollout engine (collective on all ranks)."""
        version = self.step + 1
        buckets = export_hf_weights(self.c.model_chunk, self.cfg.model, self.mesh,
                                    bucket_bytes=self.c.weight_bucket_bytes)
        if self.mesh.is_driver:
            self.c.engine.update_weights((item for bucket in buckets for item in bucket), version)
        else:
            for _ in buckets:
                pass

    def _evaluate(self) -> dict:
        payload = [None]
        if self.mesh.is_driver:
            records = self.c.task.eval_records(self.cfg.trainer.eval_prompts)
            params = replace(self.c.rollout.sampling, n=self.cfg.trainer.eval_samples,
                             temperature=self.cfg.rollout.eval_temperature,
                             seed=self.cfg.trainer.seed, return_routed_experts=False)
            payload = [self.c.rollout.evaluate(records, params)]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        state = {
            "scheduler": self.c.scheduler.state_dict(),
            "task": self.c.task.state_dict() if self.mesh.is_driver else None,
            "config": self.c.config_yaml,
        }
        return save_checkpoint(self.c.run_dir, self.step, self.c.model_chunk, self.c.optimizer, state,
                               self.cfg.checkpoint.keep_last, self.mesh.is_driver)

    def export_hf(self) -> Path:
        """The policy as a HF checkpoint in ``<run>/hf_export/`` (collective; replaced atomically)."""
        from gspo_megatron.models.hf_checkpoint import save_hf_checkpoint

        tokenizer = self.cfg.tokenizer
        out = Path(self.c.run_dir) / "hf_export"
        return save_hf_checkpoint(self.c.model_chunk, self.cfg.model, self.mesh, out,
                                  tokenizer_dir=tokenizer.path if tokenizer.kind == "hf" else None)

    def _maybe_resume(self) -> None:
        if not self.cfg.checkpoint.resume:
            return
        path = latest_checkpoint(self.c.run_dir)
        if path is None:
            if self.mesh.is_driver:
                print(f"[gspo] resume=true but {self.c.run_dir}/checkpoints has no checkpoint: starting fresh")
            return
        state = load_checkpoint(path, self.c.model_chunk, self.c.optimizer)
        self.c.scheduler.load_state_dict(state["scheduler"])
        if self.mesh.is_driver and state.get("task") is not None:
            self.c.task.load_state_dict(state["task"])
        self.step = int(state["step"])
        if self.mesh.is_driver:
            print(f"[gspo] resumed from {path} at step {self.step}")


class _timed:
    def __init__(self, store: dict, name: str):
        self.store, self.name = store, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.store[self.name] = time.perf_counter() - self.start
