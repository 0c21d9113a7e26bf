"""The composition root: the policy on every rank, the rollout side on the driver, the loop between them.

    policy   = build_policy(policy_settings(cfg))               every rank (policy/build.py)
    rollout  = build_rollout_side(rollout_settings(cfg))        the driver only (rollout/build.py)
    feed     = DriverFeed(rollout, ...) | FollowerFeed(...)     each rank's end of the batch distribution
    weights  = DriverWeightSync(...) | FollowerWeightSync(...)  each rank's end of the weight sync
    trainer  = RLTrainer(cfg, policy, feed, weights, placement, ...)

The one question of which rank drives is asked here, once: the rollout side exists on the driver only,
and every other object the loop holds is the same on every rank or one end of a collective. The
settings of each role are resolved from the whole config here too (``policy_settings``,
``rollout_settings``), so neither role reads a section that is not its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.loop.colocation import ColocatedHandOver, EnginePlacement, SeparatePlacement
from gspo_megatron.loop.distribute import (
    BatchFeed,
    DriverFeed,
    FollowerFeed,
    SharePlan,
    data_parallel_rank_of_each_rank,
)
from gspo_megatron.loop.trainer import RLTrainer
from gspo_megatron.loop.weight_sync import DriverWeightSync, FollowerWeightSync, WeightSync
from gspo_megatron.policy.build import build_policy
from gspo_megatron.policy.config import PolicySettings
from gspo_megatron.policy.parallel.layout import ParallelLayout, sequence_multiple
from gspo_megatron.policy.parallel.mesh import ParallelMesh
from gspo_megatron.policy.policy import Policy
from gspo_megatron.policy.routing.config import DiagnosticKind
from gspo_megatron.policy.routing.replay_strategy import needs_engine_routing
from gspo_megatron.rollout.build import RolloutSettings, build_rollout_side
from gspo_megatron.rollout.config import Placement, RolloutEngineName
from gspo_megatron.rollout.engines import ModelShape
from gspo_megatron.rollout.sglang.config import WeightSenders
from gspo_megatron.rollout.sglang.config import WeightSync as SGLangWeightSync

if TYPE_CHECKING:
    from gspo_megatron.rollout.sglang.stage_turns import StagePosition, StageTurns


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def build_trainer(cfg: TrainConfig, run_dir: Path, config_yaml: str, world_size: int | None = None) -> RLTrainer:
    """Everything a run needs, on this rank; the caller closes the trainer (``RLTrainer.close``)."""
    policy = build_policy(policy_settings(cfg), world_size or world_size_from_env())
    mesh, layout = policy.mesh, policy.mesh.layout
    placement: EnginePlacement = SeparatePlacement()
    if cfg.rollout.placement == Placement.colocated:  # trainer and engine take turns on the devices
        placement = ColocatedHandOver(policy.model)
    turns = stage_turns(cfg, policy)
    placement.before_engine_launch()
    dp_rank_of = data_parallel_rank_of_each_rank(mesh.dp_rank)  # who gets which rows (collective, once)
    plan = share_plan(cfg, layout)
    feed: BatchFeed
    weights: WeightSync
    if mesh.is_driver:
        rollout = build_rollout_side(rollout_settings(cfg, run_dir))
        feed = DriverFeed(rollout, plan, dp_rank_of)
        weights = DriverWeightSync(policy.export, rollout.load_weights, mesh.device, turns)
        placement.attach(rollout.engine)
    else:
        feed = FollowerFeed(dp_rank_of)
        weights = FollowerWeightSync(policy.export, mesh.device, turns)
    return RLTrainer(cfg, policy, feed, weights, placement, run_dir, config_yaml)


def policy_settings(cfg: TrainConfig) -> PolicySettings:
    """What the policy is built from: its sections, and what it reads of the trainer and rollout sections."""
    t = cfg.trainer
    return PolicySettings(
        model=cfg.model,
        parallel=cfg.parallel,
        optimizer=cfg.optimizer,
        algorithm=cfg.algorithm,
        routing=cfg.routing,
        old_log_probs=t.old_log_probs,
        seed=t.seed,
        total_updates=t.steps * t.updates_per_rollout,
        updates_per_step=t.updates_per_rollout,
        temperature=cfg.rollout.temperature,
        logprob_chunk_size=t.logprob_chunk_size,
        recompute_activations=t.recompute_activations,
        reference_offload=t.reference_offload,
        on_nonfinite=t.on_nonfinite,
        max_consecutive_nonfinite=t.max_consecutive_nonfinite,
        trajectory_turns=cfg.rollout.agent.max_turns if cfg.rollout.agent.enabled else 0,
    )


def rollout_settings(cfg: TrainConfig, run_dir: Path | None = None) -> RolloutSettings:
    """What the rollout side is built from: its sections, the model's shape as the engine's HF config,
    whether the run needs the engine's routed experts (R3, or the rollout-vs-train diagnostic), and the
    run's directory (None: a tool's engine, outside a run)."""
    t = cfg.trainer
    return RolloutSettings(
        rollout=cfg.rollout,
        task=cfg.task,
        tokenizer=cfg.tokenizer,
        reward=cfg.reward,
        shaping=cfg.shaping,
        algorithm=cfg.algorithm,
        model=ModelShape(cfg.model.family, cfg.model.to_hf_dict()),
        model_vocab_size=cfg.model.vocab_size,
        max_positions=cfg.model.max_position_embeddings,
        return_routed_experts=cfg.rollout.return_routed_experts
        or needs_engine_routing(cfg.routing.replay)
        or DiagnosticKind.rollout_vs_train in cfg.routing.kinds,
        seed=t.seed,
        prompts_per_step=t.prompts_per_step,
        steps=t.steps,
        eval_prompts=t.eval_prompts,
        eval_samples=t.eval_samples,
        run_dir=run_dir,
    )


def share_plan(cfg: TrainConfig, layout: ParallelLayout) -> SharePlan:
    t = cfg.trainer
    return SharePlan(
        dp_size=layout.dp,
        updates=t.updates_per_rollout,
        micro_batch_size=t.micro_batch_size,
        micro_batch_tokens=t.micro_batch_tokens,
        seq_multiple=sequence_multiple(layout),
    )


def senders_per_stage(cfg: TrainConfig, layout: ParallelLayout) -> bool:
    """Each pipeline stage sends its own layers: SGLang's distributed sync, ``weight_senders=per_stage``, pp > 1."""
    sglang = cfg.rollout.sglang
    return (
        cfg.rollout.engine == RolloutEngineName.sglang
        and sglang.weight_sync == SGLangWeightSync.distributed
        and sglang.weight_senders == WeightSenders.per_stage
        and layout.pp > 1
    )


def stage_turns(cfg: TrainConfig, policy: Policy) -> StageTurns | None:
    """Every rank's part in per-stage weight sends (SGLang, ``weight_senders=per_stage``, pp > 1)."""
    if not senders_per_stage(cfg, policy.mesh.layout):
        return None
    from gspo_megatron.rollout.sglang.stage_turns import StageTurns  # its HTTP client: SGLang runs only

    return StageTurns(policy.export_own_stage, stage_position(policy.mesh), cfg.rollout.sglang)


def stage_position(mesh: ParallelMesh) -> StagePosition:
    """This rank's place in the pipeline, as the stages' weight senders need it."""
    from gspo_megatron.rollout.sglang.stage_turns import StagePosition

    senders = [dist.get_global_rank(mesh.pp_group, stage) for stage in range(mesh.layout.pp)]
    return StagePosition(mesh.rank, mesh.pp_rank, mesh.is_driver, senders)
