"""Build everything a run needs from a validated ``TrainConfig``: the one place that wires layers.

The driver (global rank 0) also builds the rollout engine, the task and the reward pool; other ranks
leave those as None. Weights: from a local HF checkpoint when ``model.hf_checkpoint`` is set, else a
seeded random init that is identical for any layout (drawn in HF names, then sharded on load).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.core.run_dir import ROUTING_FILE, drop_records_from_step
from gspo_megatron.loop.colocation import ColocatedHandOver, SeparatePlacement
from gspo_megatron.policy.config import use_distributed_optimizer
from gspo_megatron.policy.models.builder import build_model_chunks
from gspo_megatron.policy.models.chunks import ModelChunks
from gspo_megatron.policy.models.conversion import hf_shapes, load_hf_weights
from gspo_megatron.policy.models.schedule import wrap_for_training
from gspo_megatron.policy.models.weight_sources import SafetensorsSource
from gspo_megatron.policy.optimizer import build_optimizer
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.policy.parallel.mesh import ParallelMesh, initialize_parallel
from gspo_megatron.policy.reference import ReferenceModel
from gspo_megatron.policy.routing.log import RoutingLog
from gspo_megatron.policy.routing.replay import RoutingReplay
from gspo_megatron.policy.routing.replay_strategy import needs_engine_routing
from gspo_megatron.rollout.agents.partial import PartialRollouts
from gspo_megatron.rollout.config import Placement, RolloutEngineName
from gspo_megatron.rollout.data.tasks import Task, build_task
from gspo_megatron.rollout.data.tokenizer import Tokenizer, build_tokenizer
from gspo_megatron.rollout.engine import RolloutEngine
from gspo_megatron.rollout.producer import RolloutPhase
from gspo_megatron.rollout.rewards.pool import RewardPool
from gspo_megatron.rollout.sglang.config import WeightSenders, WeightSync
from gspo_megatron.run.run_log import RunLog

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from gspo_megatron.loop.stage_senders import StageTurns


@dataclass
class Components:
    cfg: TrainConfig
    mesh: ParallelMesh
    run_dir: Path
    config_yaml: str
    model: ModelChunks  # the one model handle: megatron's DDP around each of this rank's GPTModel chunks
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    replay: RoutingReplay | None
    stage_moe_layers: list[int]
    engine: RolloutEngine | None = None  # driver only
    task: Task | None = None  # driver only
    rollout: RolloutPhase | None = None
    run_log: RunLog | None = None
    routing_log: RoutingLog | None = None
    reference: ReferenceModel | None = None  # frozen KL reference; None unless algorithm.kl.coef > 0
    placement: SeparatePlacement | ColocatedHandOver = field(default_factory=SeparatePlacement)
    stage_turns: StageTurns | None = None  # every rank, when each pipeline stage sends its own weights

    def driver_rollout(self) -> RolloutPhase:
        """The rollout phase, which only the driver (global rank 0) builds."""
        if self.rollout is None:
            raise RuntimeError("only the driver (global rank 0) holds the rollout phase")
        return self.rollout

    def driver_task(self) -> Task:
        """The task, which only the driver (global rank 0) builds."""
        if self.task is None:
            raise RuntimeError("only the driver (global rank 0) holds the task")
        return self.task

    def close(self) -> None:
        """Stop what the run started: reward workers, the engine (and servers it launched), groups."""
        try:
            if self.replay is not None:
                self.replay.restore()  # megatron's RouterReplay instances get their own methods back
            if self.rollout is not None:
                self.rollout.rewards.close()
        finally:
            try:
                if self.stage_turns is not None:
                    self.stage_turns.close()
                if self.engine is not None:
                    self.engine.shutdown()
            finally:
                self.mesh.destroy()


def senders_per_stage(cfg: TrainConfig, layout: ParallelLayout) -> bool:
    """Each pipeline stage sends its own layers: SGLang's distributed sync, ``weight_senders=per_stage``, pp > 1."""
    sglang = cfg.rollout.sglang
    return (
        cfg.rollout.engine == RolloutEngineName.sglang
        and sglang.weight_sync == WeightSync.distributed
        and sglang.weight_senders == WeightSenders.per_stage
        and layout.pp > 1
    )


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def random_hf_weights(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """Seeded init in HF names: normal(0, init_std) for matrices, ones for norms (any layout alike)."""
    generator = torch.Generator().manual_seed(cfg.model.init_seed)
    weights = {}
    for name, shape in hf_shapes(cfg.model).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * cfg.model.init_std
    return weights


def stage_moe_layers(model_chunk: GPTModel) -> list[int]:
    """Global indices of a model chunk's MoE layers, in the order their routers were built."""
    layers = []
    for layer in model_chunk.decoder.layers:
        if hasattr(layer.mlp, "router"):
            layers.append(layer.layer_number - 1)
    return layers


def build(cfg: TrainConfig, run_dir: Path, config_yaml: str, world_size: int | None = None) -> Components:
    layout = cfg.parallel.layout(world_size or world_size_from_env()).validate(cfg.model)
    mesh = initialize_parallel(layout, seed=cfg.trainer.seed, timeout_s=cfg.parallel.timeout_s)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    instances_before = RoutingReplay.instance_count()
    chunks = build_model_chunks(
        cfg.model,
        layout,
        params_dtype=dtype,
        layer_spec=cfg.model.layer_spec,
        token_dispatcher=cfg.model.token_dispatcher,
        expert_mlp=cfg.model.expert_mlp,
        recompute=cfg.trainer.recompute_activations,
    )
    moe_layers = [stage_moe_layers(chunk) for chunk in chunks]  # per chunk, in router build order
    replay = None
    if cfg.model.is_moe:
        replay = RoutingReplay.capture_new_instances(instances_before, [len(layers) for layers in moe_layers])
    source = SafetensorsSource(cfg.model.hf_checkpoint) if cfg.model.hf_checkpoint else random_hf_weights(cfg)
    load_hf_weights(chunks, cfg.model, source, mesh)
    reference = ReferenceModel.build(cfg, layout, mesh, source, dtype) if cfg.algorithm.kl.coef > 0 else None
    distributed = use_distributed_optimizer(cfg.optimizer.distributed, layout)
    ddp = ModelChunks(wrap_for_training(chunk, chunk.config, use_distributed_optimizer=distributed) for chunk in chunks)
    total_updates = cfg.trainer.steps * cfg.trainer.updates_per_rollout
    optimizer, scheduler = build_optimizer(ddp, cfg.optimizer, total_updates)
    components = Components(
        cfg=cfg,
        mesh=mesh,
        run_dir=run_dir,
        config_yaml=config_yaml,
        model=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        replay=replay,
        stage_moe_layers=[layer for layers in moe_layers for layer in layers],
        reference=reference,
    )
    if cfg.rollout.placement == Placement.colocated:  # trainer and engine take turns on the devices
        components.placement = ColocatedHandOver(ddp)
    if senders_per_stage(cfg, layout):
        from gspo_megatron.loop.stage_senders import StageTurns  # the HTTP client: SGLang runs only

        components.stage_turns = StageTurns(ddp, cfg.model, mesh, cfg.rollout.sglang)
    components.placement.before_engine_launch()
    if mesh.is_driver:
        _build_driver_side(components)
    components.placement.attach(components.engine)
    return components


def build_rollout_phase(cfg: TrainConfig) -> RolloutPhase:
    """The driver's rollout half -- tokenizer, task, engine (no weights yet), verifier pool, sampling --
    as training uses it; also what evaluates a checkpoint on its own (tools/shaping_study.py)."""
    tokenizer = build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path, model_vocab_size=cfg.model.vocab_size)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}; "
            "raise model.vocab_size (a multiple of parallel.tp)"
        )
    task = build_task(cfg.task, tokenizer, cfg.prompt_token_budget())  # prompts past the context are dropped
    engine = _build_engine(cfg, tokenizer)
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=tuple(tokenizer.stop_token_ids),
        n=cfg.rollout.group_size,
        return_routed_experts=cfg.rollout.return_routed_experts
        or needs_engine_routing(cfg.routing.replay)
        or "rollout_vs_train" in cfg.routing.kinds,
    )
    generate_fn = None
    if cfg.rollout.truncated:
        from gspo_megatron.rollout.agents.truncated import TruncatedRolloutEngine
        from gspo_megatron.rollout.shaping.triggers import check_trigger_token_ids

        triggers = cfg.shaping.trigger_words
        check_trigger_token_ids(cfg.rollout.truncation.trigger_token_ids, triggers, tokenizer.decode)
        generate_fn = TruncatedRolloutEngine(
            engine, cfg.rollout.truncation, triggers, tokenizer.encode, tokenizer.decode
        ).generate
    return RolloutPhase(
        engine=engine,
        task=task,
        tokenizer=tokenizer,
        rewards=RewardPool(cfg.shaping.reward_name(cfg.task.reward or task.reward), cfg.reward),
        algorithm=cfg.algorithm,
        shaping=cfg.shaping,
        sampling=sampling,
        seed=cfg.trainer.seed,
        pad_token_id=tokenizer.pad_token_id,
        generate_fn=generate_fn,
        train_on_exit_tokens=cfg.rollout.truncated and cfg.rollout.truncation.train_on_exit_tokens,
        partial=PartialRollouts(cfg.rollout.over_sample, cfg.rollout.partial, cfg.rollout.max_staleness)
        if cfg.rollout.over_sample > 1
        else None,
    )


def evaluation_inputs(cfg: TrainConfig, phase: RolloutPhase) -> tuple[list, SamplingParams]:
    """The run's evaluation prompts (``trainer.eval_prompts``) and sampling (``trainer.eval_samples``
    per prompt at ``rollout.eval_temperature``, the run's seed, no routed experts)."""
    params = replace(
        phase.sampling,
        n=cfg.trainer.eval_samples,
        temperature=cfg.rollout.eval_temperature,
        seed=cfg.trainer.seed,
        return_routed_experts=False,
    )
    return phase.task.eval_records(cfg.trainer.eval_prompts), params


def build_evaluation(cfg: TrainConfig) -> tuple[RolloutPhase, list, SamplingParams]:
    """A rollout phase with the run's evaluation prompts and sampling: what the trainer evaluates,
    for evaluating weights outside a run. The caller loads the engine's weights."""
    phase = build_rollout_phase(cfg)
    return phase, *evaluation_inputs(cfg, phase)


def _build_driver_side(c: Components) -> None:
    cfg = c.cfg
    c.rollout = build_rollout_phase(cfg)
    c.task, c.engine = c.rollout.task, c.rollout.engine
    resume_step = _resume_step(c)
    c.run_log = RunLog(
        c.run_dir,
        cfg.trainer.steps,
        tensorboard=cfg.logging.tensorboard,
        wandb_project=cfg.logging.wandb_project if cfg.logging.wandb else None,
        progress=cfg.logging.progress,
        charts=cfg.logging.charts,
        config_yaml=c.config_yaml,
        resume_step=resume_step,
    )
    drop_records_from_step(c.run_dir / ROUTING_FILE, resume_step + 1)
    if cfg.routing.enabled and cfg.model.is_moe:
        c.routing_log = RoutingLog(c.run_dir)


def _resume_step(c: Components) -> int:
    from gspo_megatron.core.run_dir import ResumeMode, resume_mode
    from gspo_megatron.policy.checkpoint.store import latest_checkpoint

    if resume_mode(c.cfg.checkpoint.resume) is ResumeMode.false:
        return 0
    path = latest_checkpoint(c.run_dir)
    return int(path.name.split("_")[-1]) if path is not None else 0


def _build_engine(cfg: TrainConfig, tokenizer: Tokenizer) -> RolloutEngine:
    if cfg.rollout.engine == RolloutEngineName.embedded:
        from gspo_megatron.rollout.embedded.engine import EmbeddedEngine

        return EmbeddedEngine(cfg.model.to_hf_config(), cfg.rollout.embedded, decode=tokenizer.decode)
    if cfg.rollout.engine == RolloutEngineName.sglang:
        from gspo_megatron.rollout.sglang.engine import SGLangEngine

        return SGLangEngine(cfg.rollout.sglang)
    raise ValueError(f"rollout.engine={cfg.rollout.engine!r} is unknown; valid: embedded, sglang")
