"""The job ``python -m gspo_megatron.train <overrides>`` would run, as the planner needs it.

Design decisions:
- One source of truth. The config is composed, typed and validated by the entry point's own steps,
  in its order (``train.py:run``): ``config/compose.py`` (the same ``conf/`` and schema), the HF
  checkpoint's shape merged over the model section when ``model.hf_checkpoint`` is set,
  ``to_train_config`` (every section validates itself) and ``validate_config`` at the planned world
  size. A config the trainer refuses is refused here with the trainer's message.
- Every option the cost model reads is derived from that config, through the trainer's own rule
  where it has one, and ``describe()`` names the key each came from:
  ``optimizer.distributed`` -> ``policy/optimizer.py:use_distributed_optimizer`` (auto = dp > 1);
  ``model.dtype``; ``trainer.recompute_activations``; ``algorithm.kl.coef > 0`` -> a reference model;
  ``trainer.old_log_probs=trainer`` -> a forward pass before the updates;
  ``trainer.updates_per_rollout``; ``routing.replay``; ``model.token_dispatcher``;
  ``model.layer_spec`` (``auto`` plans ``te``: a GPU has TransformerEngine; ``portable`` where only it builds the
  model: ``MoEModelConfig.portable_spec_only``, the hybrids' gated DeltaNet and OLMoE); the rollout engine
  (``rollout.engine``; SGLang servers x ``rollout.sglang.tp`` GPUs of their own; the embedded
  engine runs in the driver's process); ``rollout.sglang.weight_bucket_bytes``; ``rollout.async_rollout``.
- Batch: ``prompts_per_step x group_size / updates_per_rollout`` rows per optimizer step, split over
  dp; a micro-batch holds ``min(trainer.micro_batch_size, rows per rank)`` rows, or with
  ``trainer.micro_batch_tokens`` as many rows as the budget takes (the trainer packs by real
  lengths; the plan pads every row to the longest). Rows are ``prompt_tokens + rollout.max_new_tokens``
  long and the model reads ``tokens[:, :-1]`` of them (``contracts/batch.py``), padded to tp (under
  sequence parallelism) x 2cp as the trainer pads them: ``seq_len`` is that fed length. How long
  prompts are is a property of the data, the one number the config cannot say, so it is an
  explicit assumption of the plan.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.rollout.config import LEAN_FORWARD_MODEL_TYPE, EmbeddedForward
from planning.hardware import GPUSpec
from planning.planner import Plan, PlanOptions, candidate_layouts, order_plans, plan_layout
from planning.step_time import RolloutShape

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from gspo_megatron.config.schema import TrainConfig


@dataclass(frozen=True)
class PlannedJob:
    config: TrainConfig
    layout: ParallelLayout
    options: PlanOptions
    prompt_tokens: int
    notes: tuple[str, ...] = ()  # what the plan assumed in place of what this machine lacks

    def describe(self) -> list[str]:
        """Each derived option beside the config key it came from."""
        cfg, o = self.config, self.options
        return [
            f"layout {self.layout} (parallel.*, world {self.layout.world_size})",
            f"optimizer.distributed={cfg.optimizer.distributed} -> distributed optimizer {o.distributed_optimizer}",
            f"model.dtype={o.dtype}; trainer.recompute_activations={o.recompute}",
            f"algorithm.kl.coef={cfg.algorithm.kl.coef} -> reference model {o.reference_model}; "
            f"trainer.reference_offload={o.reference_offload}; optimizer.cpu_offload={cfg.optimizer.cpu_offload} "
            f"-> {o.optimizer_offload:.0%} of Adam in host memory; optimizer.precision_aware={o.precision_aware}, "
            f"state bytes per element (master, exp_avg, exp_avg_sq) {o.state_widths.master}, "
            f"{o.state_widths.exp_avg}, {o.state_widths.exp_avg_sq}",
            f"trainer.old_log_probs={cfg.trainer.old_log_probs} -> old-log-prob pass {o.old_log_prob_pass}",
            f"trainer.updates_per_rollout={o.updates_per_rollout}; routing.replay={o.routing_replay}; "
            f"model.token_dispatcher={o.dispatcher}; model.layer_spec={cfg.model.layer_spec} -> {o.layer_spec}",
            f"rows of {o.seq_len} fed tokens (prompt {self.prompt_tokens} assumed + rollout.max_new_tokens "
            f"{cfg.rollout.max_new_tokens} - 1, padded); {o.global_batch_tokens // o.seq_len} rows per optimizer step, "
            f"{o.micro_batch_tokens // o.seq_len} per micro-batch",
            f"rollout.engine={cfg.rollout.engine} -> {_describe_rollout(o.rollout)}; "
            f"rollout.async_rollout={o.async_rollout}; weight_bucket_bytes={o.sync_bucket_bytes}; "
            f"weight_senders={o.sync_senders}",
            *self.notes,
        ]


def _describe_rollout(shape: RolloutShape | None) -> str:
    if shape is None:
        return "not planned"
    where = "colocated with the trainer" if shape.colocated else "on GPUs of their own"
    return f"{shape.servers} engine(s) x {shape.engine_tp} GPU(s) {where}"


def compose_job(overrides: list[str], gpus: int, prompt_tokens: int) -> PlannedJob:
    """Compose ``conf/`` with ``overrides`` exactly as the entry point does, then derive the plan's options."""
    from omegaconf import OmegaConf

    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config

    cfg = compose(list(overrides))
    notes: tuple[str, ...] = ()
    checkpoint = cfg.model.hf_checkpoint
    local = local_checkpoint(checkpoint) if checkpoint else None
    if local:  # as train.py: the weights decide the model's shape
        from gspo_megatron.policy.models.hf_checkpoint import hf_shape_fields

        cfg = cast("DictConfig", OmegaConf.merge(cfg, {"model": hf_shape_fields(local)}))
    elif checkpoint:  # a cluster's path, planned from elsewhere: the configured shape stands in for it
        notes = (
            f"model.hf_checkpoint={checkpoint} is not on this machine: planned with the configured shape "
            f"(model.preset={cfg.model.preset}); the trainer reads the shape from the checkpoint",
        )
        cfg.model.hf_checkpoint = None
    job = job_from_config(to_train_config(cfg), gpus, prompt_tokens)
    return dataclasses.replace(job, notes=notes)


def local_checkpoint(value: str) -> str | None:
    """The folder ``model.hf_checkpoint`` names on this machine: a directory, or a hub id already in the hub
    cache (``core/hub_checkpoints.py``); the planner never downloads. None when neither."""
    from gspo_megatron.core.hub_checkpoints import cached_snapshot, looks_like_hub_id

    if Path(value).expanduser().is_dir():
        return value
    return cached_snapshot(value) if looks_like_hub_id(value) else None


def job_from_config(cfg: TrainConfig, gpus: int, prompt_tokens: int) -> PlannedJob:
    from gspo_megatron.config.validate import validate_config

    if prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens={prompt_tokens} must be >= 1 (tokens of the longest prompt)")
    validate_config(cfg, gpus)
    layout = cfg.parallel.layout(gpus).validate(cfg.model)
    return PlannedJob(cfg, layout, options_from_config(cfg, layout, prompt_tokens), prompt_tokens)


def with_layout(job: PlannedJob, layout: ParallelLayout) -> PlannedJob:
    """The same job on another layout (for ranking): the config's parallel section replaced, validated."""
    from gspo_megatron.policy.config import ParallelSection

    cfg = copy.deepcopy(job.config)
    for name in ParallelSection.LAYOUT_KEYS:
        setattr(cfg.parallel, name, getattr(layout, name))
    return job_from_config(cfg, layout.world_size, job.prompt_tokens)


def options_from_config(cfg: TrainConfig, layout: ParallelLayout, prompt_tokens: int) -> PlanOptions:
    from gspo_megatron.algorithms.config import OldLogProbSource
    from gspo_megatron.policy.config import STATE_DTYPE_BYTES, use_distributed_optimizer
    from gspo_megatron.policy.parallel.layout import sequence_multiple
    from gspo_megatron.rollout.config import Placement, RolloutEngineName
    from planning.parameters import StateWidths
    from planning.rl_step_memory import EmbeddedEngineShape

    t, rollout = cfg.trainer, cfg.rollout
    # the model reads tokens[:, :-1] of each prompt + response row (contracts/batch.py), padded to the
    # layout's multiple (policy/parallel/context_parallel.py:pad_sequence_length)
    multiple = sequence_multiple(layout)
    seq_len = -(-(prompt_tokens + rollout.max_new_tokens - 1) // multiple) * multiple
    sequences = t.prompts_per_step * rollout.group_size
    per_update = sequences // t.updates_per_rollout
    per_rank = per_update // layout.dp
    if t.micro_batch_tokens is not None:
        rows = max(1, min(per_rank, t.micro_batch_tokens // seq_len))
    else:
        rows = min(t.micro_batch_size, per_rank)
    embedded, engine_fraction = None, None
    if rollout.engine == RolloutEngineName.sglang:
        sg = rollout.sglang
        servers = len(sg.urls) if sg.mode == "attach" else sg.num_servers
        colocated = rollout.placement == Placement.colocated
        shape = RolloutShape(sequences, prompt_tokens, rollout.max_new_tokens, servers, sg.tp, colocated=colocated)
        engine_fraction = static_memory_fraction(sg.extra_args) if colocated else None
    else:  # the embedded engine generates in the driver's process, on its GPU, between training phases
        shape = RolloutShape(sequences, prompt_tokens, rollout.max_new_tokens, 1, 1, colocated=True)
        lean = rollout.embedded.forward == EmbeddedForward.lean and cfg.model.family == LEAN_FORWARD_MODEL_TYPE
        embedded = EmbeddedEngineShape(str(rollout.embedded.dtype), rollout.embedded.max_batch_size, lean)
    # the builder's rule: "auto" is TE on a GPU, but the portable spec where only it builds the model
    portable = str(cfg.model.layer_spec) == "portable" or (
        str(cfg.model.layer_spec) == "auto" and cfg.model.portable_spec_only
    )
    layer_spec = "portable" if portable else "te"
    return PlanOptions(
        seq_len=seq_len,
        micro_batch_tokens=rows * seq_len,
        global_batch_tokens=per_update * seq_len,
        group_size=rollout.group_size,
        dtype=str(cfg.model.dtype),
        distributed_optimizer=use_distributed_optimizer(cfg.optimizer.distributed, layout),
        optimizer_offload=cfg.optimizer.offload_fraction if cfg.optimizer.cpu_offload else 0.0,
        precision_aware=cfg.optimizer.precision_aware,
        state_widths=StateWidths(
            *(STATE_DTYPE_BYTES[getattr(cfg.optimizer, key)] for key in cfg.optimizer.STATE_DTYPE_KEYS)
        ),
        recompute=t.recompute_activations,
        routing_replay=str(cfg.routing.replay),
        dispatcher=str(cfg.model.token_dispatcher),
        layer_spec=layer_spec,
        sync_bucket_bytes=rollout.sglang.weight_bucket_bytes,
        sync_senders=str(rollout.sglang.weight_senders),
        reference_model=cfg.algorithm.kl.coef > 0,
        reference_offload=cfg.trainer.reference_offload,
        old_log_prob_pass=cfg.trainer.old_log_probs == OldLogProbSource.trainer,
        updates_per_rollout=t.updates_per_rollout,
        rollout=shape,
        async_rollout=rollout.async_rollout,
        embedded_engine=embedded,
        colocated_engine_fraction=engine_fraction,
    )


def static_memory_fraction(extra_args: list[str]) -> float:
    """A colocated SGLang server's share of each GPU: its ``--mem-fraction-static`` (weights and KV cache),
    which the plan needs and SGLang would otherwise pick by itself from the free memory at launch."""
    for i, arg in enumerate(extra_args):
        value = arg.split("=", 1)[1] if arg.startswith("--mem-fraction-static=") else None
        if arg == "--mem-fraction-static" and i + 1 < len(extra_args):
            value = extra_args[i + 1]
        if value is not None:
            fraction = float(value)
            if not 0 < fraction < 1:
                raise ValueError(f"rollout.sglang.extra_args: --mem-fraction-static {value} must be in (0, 1)")
            return fraction
    raise ValueError(
        "rollout.placement=colocated with SGLang: the plan needs the engine's share of each GPU; add "
        "--mem-fraction-static to rollout.sglang.extra_args (e.g. "
        "'rollout.sglang.extra_args=[--mem-fraction-static,\"0.7\"]')"
    )


def plan_job(job: PlannedJob, gpu: GPUSpec) -> Plan:
    return plan_layout(job.config.model, job.layout, job.options, gpu, validated=True)


def rank_job(job: PlannedJob, gpu: GPUSpec, max_cp: int = 2) -> tuple[list[Plan], list[Plan]]:
    """Every layout of the job's world size that the trainer accepts for this config, ordered by
    ``planner.order_plans`` (the configured layout is one of the candidates)."""
    plans = []
    for layout in candidate_layouts(job.config.model, job.layout.world_size, gpu, max(max_cp, job.layout.cp)):
        try:
            plans.append(plan_job(with_layout(job, layout), gpu))
        except ValueError:  # the trainer's validation refuses this layout for this config
            continue
    return order_plans(plans)
