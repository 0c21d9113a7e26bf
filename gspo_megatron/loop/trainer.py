"""The RL loop: one step, top to bottom, as the phase calls of ``train_step``.

    share   = feed.share(step)                          rollout on the driver; each rank's rows to it
    old     = policy.old_log_probs(step, ...)           pi_old: a forward-only pass (routing recorded/replayed)
    ...     = correct_mismatch(...)                     importance weights / rejection by pi_old / pi_rollout
    ref     = policy.reference_log_probs(...)           the frozen KL reference, when algorithm.kl.coef > 0
    update  = policy.update(step, ...)                  k mini-batch updates, routing replayed when on
    weights.sync(version)                               the policy's HF-named tensors into the engine
    routing = policy.finish_step(step)                  the step's routing diagnostics
    -> StepResult: metrics.jsonl's line and routing.jsonl's records; a checkpoint when due

Every rank runs this loop (SPMD) with the same objects' roles: the policy (every rank's share of the
model, ``policy/policy.py``), the feed (``loop/distribute.py``: the driver's end holds the rollout side,
every other rank's receives its rows) and the weight sync (``loop/weight_sync.py``: the driver's end
loads the engine, the others join the export). The composition root (``loop/build.py``) chose them;
the loop never asks which rank it runs on. What is written for people -- metrics, routing records,
notes -- goes to the ``StepLog`` the run layer hands over (the driver's run log; the others' is quiet).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from gspo_megatron.algorithms.adaptive_clip import AdaptiveClipController
from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.contracts.batch import cut_micro_batches, update_batches
from gspo_megatron.contracts.micro_batch import StepMicroBatch
from gspo_megatron.contracts.phases import UpdateResult
from gspo_megatron.contracts.token_budget import step_fed_shape
from gspo_megatron.core.interrupts import RunInterrupted
from gspo_megatron.core.provenance import warm_start_record
from gspo_megatron.core.run_dir import ResumeMode, RunDirError, new_run_id, resume_mode
from gspo_megatron.loop.colocation import EnginePlacement
from gspo_megatron.loop.corrections import correct_mismatch
from gspo_megatron.loop.distribute import BatchFeed
from gspo_megatron.loop.weight_sync import WeightSync
from gspo_megatron.policy.checkpoint.store import latest_checkpoint
from gspo_megatron.policy.device_memory import device_memory_peaks
from gspo_megatron.policy.parallel.heartbeat import is_collective_failure
from gspo_megatron.policy.parallel.layout import sequence_multiple
from gspo_megatron.policy.policy import Policy


class StepLog(Protocol):
    """Where the loop's results go for people: the driver's run log (``run/run_log.py``), or ``QuietLog``."""

    def write_config(self, **inputs: object) -> None: ...

    def log_step(self, step: int, metrics: dict[str, float], routing_records: list[dict]) -> None: ...

    def note(self, text: str) -> None: ...

    def close(self) -> str: ...


class QuietLog:
    """The log of a rank that writes nothing: the driver writes the run directory and speaks for the run."""

    def write_config(self, **inputs: object) -> None:
        return None

    def log_step(self, step: int, metrics: dict[str, float], routing_records: list[dict]) -> None:
        return None

    def note(self, text: str) -> None:
        return None

    def close(self) -> str:
        return ""


class SignalSource(Protocol):
    def agreed_signal(self) -> int:
        """Collective: the signal any rank received since the start (0: none)."""


@dataclass(frozen=True)
class StepResult:
    metrics: dict[str, float]  # metrics.jsonl's line of the step
    routing_records: list[dict] = field(default_factory=list)  # routing.jsonl's records of the step


class RLTrainer:
    def __init__(
        self,
        cfg: TrainConfig,
        policy: Policy,
        feed: BatchFeed,
        weights: WeightSync,
        placement: EnginePlacement,
        run_dir: Path,
        config_yaml: str,
    ) -> None:
        """Built by ``loop/build.py:build_trainer``. ``placement``: the hand-over between engine and trainer
        (``rollout.placement``)."""
        self.cfg, self.policy, self.feed, self.weights, self.placement = cfg, policy, feed, weights, placement
        self.run_dir, self.config_yaml = run_dir, config_yaml
        self.step = 0
        self.run_id = new_run_id()  # a resumed run takes its checkpoint's id (pruning is per run)
        self.clip_controller = AdaptiveClipController.from_config(cfg.algorithm)  # None: fixed eps
        self.log: StepLog = QuietLog()  # ``train`` hands over the run's
        self.signals: SignalSource | None = None

    # ------------------------------------------------------------------ the run
    def train(self, log: StepLog, signals: SignalSource | None = None) -> str:
        """The run, from a resumed step when asked; returns the run log's summary. ``signals``, if given,
        is asked between steps (SIGTERM/SIGINT: save and stop). A failed collective is re-raised naming
        the silent rank (``policy/parallel/heartbeat.py``)."""
        self.log, self.signals = log, signals
        mesh = self.policy.mesh
        try:
            return self._train()
        except RuntimeError as error:
            if mesh.heartbeat is None or not is_collective_failure(error):
                raise
            raise CollectiveFailure(mesh.heartbeat.explain(error, mesh.timeout_s)) from error

    def _train(self) -> str:
        cfg = self.cfg
        self._maybe_resume()
        # only now: a refused or failed resume leaves config.yaml alone
        self.log.write_config(
            cpu_threads=torch.get_num_threads(), warm_start=warm_start_record(cfg.model.hf_checkpoint)
        )
        self.sync_weights(version=self.step)
        last = self._last_step()
        while self.step < last:
            result = self.train_step()
            self.step += 1
            self.log.log_step(self.step, result.metrics, result.routing_records)
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
        return self.log.close()

    def _last_step(self) -> int:
        t = self.cfg.trainer
        return t.steps if t.stop_after_steps is None else min(t.steps, t.stop_after_steps)

    def _shared_prefix_multiple(self) -> int | None:
        """``trainer.shared_prefix``: the packed width's multiple (the fed length's); None: off."""
        return sequence_multiple(self.policy.mesh.layout) if self.cfg.trainer.shared_prefix else None

    def _phase(self, timings: dict, name: str) -> _timed:
        self.policy.mesh.enter(f"step {self.step + 1}, {name}")
        return _timed(timings, name)

    # ------------------------------------------------------------------ one RL step
    def train_step(self) -> StepResult:
        timings: dict[str, float] = {}
        with self._phase(timings, "rollout"):
            share = self.feed.share(self.step)
            self.placement.after_generation()
        batch, totals, metrics = share.batch, share.totals, dict(share.metrics)
        minibatches = cut_micro_batches(batch, share.plan, shared_prefix_multiple=self._shared_prefix_multiple())
        fed = step_fed_shape(minibatches, self.policy.mesh.layout.dp)
        metrics["batch/padded_token_frac"] = fed.padded_fraction(totals.input_tokens)
        metrics.update(fed.metrics())
        flat = [mb for minibatch in minibatches for mb in minibatch]
        with self._phase(timings, "old_logp"):
            old = self.policy.old_log_probs(self.step, batch, flat)
        old_metrics = dict(old.metrics)
        if self.cfg.algorithm.mismatch.active:  # importance weights pi_old / pi_rollout
            mismatch = correct_mismatch(
                batch, old.log_probs, minibatches, self.cfg.algorithm, totals, self.policy.mesh.other_rows_group
            )
            minibatches, totals = mismatch.minibatches, mismatch.totals
            old_metrics.update(mismatch.metrics)
        reference = self._reference_pass(timings, flat)
        updates = update_batches(minibatches, batch, old.log_probs, reference)  # what the loss reads, built once
        with self._phase(timings, "update"):
            update = self.policy.update(self.step, updates, totals, self._clip())
        with self._phase(timings, "weight_sync"):
            self.sync_weights()
        metrics.update(old_metrics)
        metrics.update(update.metrics)
        metrics.update(self._adapt_clip(update))
        routing = self.policy.finish_step(self.step + 1)
        metrics.update(routing.metrics)
        eval_every = self.cfg.trainer.eval_every
        if eval_every and (self.step + 1) % eval_every == 0:
            metrics.update(self.feed.evaluate())
        metrics.update(self.placement.metrics())
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        metrics.update(device_memory_peaks(self.policy.mesh.device))
        metrics["lr"] = self.policy.lr
        return StepResult(metrics, routing.records)

    # ------------------------------------------------------------------ phases
    def _reference_pass(self, timings: dict, micro_batches: list[StepMicroBatch]) -> list[torch.Tensor] | None:
        """The frozen reference's log-probs (algorithm.kl.coef > 0; its routers never replay)."""
        if self.policy.reference is None:
            return None
        with self._phase(timings, "ref_logp"):
            return self.policy.reference_log_probs(micro_batches)

    def _clip(self) -> tuple[float, float] | None:
        """This step's (eps_low, eps_high) from adaptive clipping; None: the configured ones."""
        return None if self.clip_controller is None else self.clip_controller.eps

    def _adapt_clip(self, update: UpdateResult) -> dict[str, float]:
        """Adaptive clipping (off: no metrics): eps for the next step from this step's clip fraction."""
        if self.clip_controller is None:
            return {}
        clipped = self.clip_controller.measured(update.clip_fractions)
        metrics = self.clip_controller.update(clipped)
        if metrics["clip/held"]:
            self.log.note(
                f"[gspo] step {self.step + 1}: {self.clip_controller.metric} is {clipped} (no valid token "
                "or a skipped update); adaptive clip held eps for the next step (metric clip/held=1)"
            )
        return metrics

    def sync_weights(self, version: int | None = None) -> None:
        """Stream the policy's HF-named weights into the rollout engine (collective on all ranks).
        ``version``: optimizer steps trained into the weights (default: after this step's update)."""
        version = self.step + 1 if version is None else version
        self.placement.before_weight_sync()
        self.feed.before_weight_sync()  # an in-flight generation finishes on the old weights
        self.weights.sync(version)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        self.policy.mesh.enter(f"step {self.step}, checkpoint save")
        rollout = self.feed.state_dict()
        state = {
            "task": rollout["task"],
            "config": self.config_yaml,
            "clip_controller": self.clip_controller.state_dict() if self.clip_controller else None,
            "rollout_scheduler": rollout["rollout_scheduler"],
            "partial_rollouts": rollout["partial_rollouts"],
        }
        return self.policy.save(self.run_dir, self.step, state, self.cfg.checkpoint.keep_last, self.run_id)

    def export_hf(self) -> Path:
        """The policy as a HF checkpoint in ``<run>/hf_export/`` (collective; replaced atomically)."""
        tokenizer = self.cfg.tokenizer
        return self.policy.export_hf(
            Path(self.run_dir) / "hf_export", tokenizer_dir=tokenizer.path if tokenizer.kind == "hf" else None
        )

    def _maybe_resume(self) -> None:
        mode = resume_mode(self.cfg.checkpoint.resume)
        if mode is ResumeMode.false:
            return
        path = latest_checkpoint(self.run_dir)
        if path is None:
            if mode is ResumeMode.true:
                raise RunDirError(f"checkpoint.resume=true but {self.run_dir}/checkpoints holds no checkpoint")
            return
        state = self.policy.load(path)  # NaN weights refused here
        self.run_id = state.get("run_id", "")
        self.feed.load_state_dict(state)
        self.step = int(state["step"])
        if self.clip_controller is not None and state.get("clip_controller") is not None:
            self.clip_controller.load_state_dict(state["clip_controller"])
        self.log.note(f"[gspo] resumed from {path} at step {self.step}; lr {self.policy.lr:.6g}")

    def _stop_if_signalled(self, saved: Path | None) -> None:
        """Collective: when any rank got SIGTERM/SIGINT, save (unless just saved) and raise."""
        signum = self.signals.agreed_signal() if self.signals is not None else 0
        if not signum:
            return
        if self.cfg.checkpoint.save_on_signal:
            saved = saved or self.save()
        outcome = signal_stop_outcome(saved, latest_checkpoint(self.run_dir))
        raise TrainingInterrupted(signum, f"stopped by {signal.Signals(signum).name} after step {self.step}; {outcome}")

    def close(self) -> None:
        """Stop what the run started: the rollout side (reward workers, the engine and the servers it
        launched), the weight senders, megatron's routers and the process groups."""
        try:
            self.weights.close()  # a stage's sender leaves its group while the servers still run
            self.feed.close()
        finally:
            self.policy.close()


class TrainingInterrupted(RunInterrupted):
    """The run stopped on a signal (``run/signals.py``); the process exits 128 + the signal's number. A
    ``RunInterrupted``, which the rollout side lets through unwrapped (``core/interrupts.py``)."""


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
