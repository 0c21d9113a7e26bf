"""Cross-section validation, once, before anything is built: every rule that needs two sections.

Each section's own rules live with its dataclass (run by ``OmegaConf.to_object``); here are the
rules that relate sections, each raising ``ConfigError`` that names both sides and the fix.
"""

from __future__ import annotations

from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.config_node import config_nodes
from gspo_megatron.parallel.context_parallel import validate_context_parallel
from gspo_megatron.routing.replay import validate_replay_mode
from gspo_megatron.routing.replay_strategy import needs_engine_routing, replays
from gspo_megatron.shaping.triggers import check_shared_triggers


class ConfigError(ValueError):
    pass


def validate_config(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Every section's own rules (``ConfigNode.validate``, again: fields may have been set since
    construction), then the rules that span sections."""
    for node in config_nodes(cfg):
        node.validate()
    layout = cfg.parallel.layout(world_size).validate(cfg.model)
    validate_context_parallel(layout.cp, cfg.model.max_position_embeddings)
    t = cfg.trainer
    for name in ("steps", "prompts_per_step", "updates_per_rollout", "micro_batch_size"):
        if getattr(t, name) < 1:
            raise ConfigError(f"trainer.{name} must be >= 1, got {getattr(t, name)}")
    if t.micro_batch_tokens is not None and t.micro_batch_tokens < 1:
        raise ConfigError(f"trainer.micro_batch_tokens must be >= 1 or null (off), got {t.micro_batch_tokens}")
    if t.eval_samples > 1 and cfg.rollout.eval_temperature == 0:
        raise ConfigError(
            f"trainer.eval_samples={t.eval_samples} with greedy decoding (rollout.eval_temperature=0) gives "
            "k identical samples; set rollout.eval_temperature > 0 or trainer.eval_samples=1"
        )
    if cfg.rollout.group_size < 2:
        raise ConfigError(
            f"rollout.group_size={cfg.rollout.group_size}: group-relative advantages need >= 2 responses per prompt"
        )
    samples = t.prompts_per_step * cfg.rollout.group_size
    if samples % t.updates_per_rollout:
        raise ConfigError(
            f"trainer.prompts_per_step * rollout.group_size = {samples} is not divisible by "
            f"trainer.updates_per_rollout = {t.updates_per_rollout}"
        )
    per_update = samples // t.updates_per_rollout
    if per_update % layout.dp:
        raise ConfigError(
            f"each mini-batch has {per_update} sequences, not divisible by the data-parallel size {layout.dp} "
            f"(world {world_size} / (tp*pp*cp)); change trainer.prompts_per_step or the layout"
        )
    per_rank = per_update // layout.dp
    if t.micro_batch_size < per_rank and per_rank % t.micro_batch_size:
        raise ConfigError(
            f"trainer.micro_batch_size={t.micro_batch_size} does not divide the {per_rank} sequences each "
            f"data-parallel rank gets per mini-batch (megatron's schedule needs equal micro-batches); "
            f"choose a divisor of {per_rank}"
        )
    _validate_run_safety(cfg)
    if cfg.rollout.engine not in ("embedded", "sglang"):
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is unknown; valid: embedded, sglang")
    if cfg.rollout.engine == "sglang":  # before the model is built, not when the engine starts
        try:
            cfg.rollout.sglang.require_targets()
        except ValueError as error:
            raise ConfigError(f"rollout.sglang: {error}") from error
    if cfg.rollout.engine == "embedded" and cfg.model.shared_expert_intermediate_size:
        raise ConfigError(
            "the embedded engine (HF Qwen3-MoE) has no shared expert; set model.shared_expert_intermediate_size=0"
        )
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be float32 or bfloat16, got {cfg.model.dtype!r}")
    _validate_routed_experts_source(cfg)
    validate_replay_mode(cfg.algorithm.routing_replay, recompute=t.recompute_activations, pp=layout.pp)
    if replays(cfg.algorithm.routing_replay) and not cfg.model.is_moe:
        raise ConfigError("algorithm.routing_replay needs an MoE model (model.num_experts > 0)")
    if (
        needs_engine_routing(cfg.algorithm.routing_replay)
        and cfg.rollout.engine == "sglang"
        and not cfg.rollout.sglang.enable_return_routed_experts
    ):
        raise ConfigError(
            "algorithm.routing_replay=rollout (R3) needs the engine's routed experts: set "
            "rollout.sglang.enable_return_routed_experts=true"
        )
    if cfg.rollout.truncated:
        try:
            check_shared_triggers(cfg.shaping, cfg.rollout.truncation.trigger_words)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if cfg.rollout.max_staleness not in (0, 1):
        raise ConfigError(
            f"rollout.max_staleness={cfg.rollout.max_staleness}: one-step asynchronous rollout supports 0 "
            "(synchronous) or 1"
        )
    prompt_budget = cfg.model.max_position_embeddings - cfg.rollout.max_new_tokens
    if prompt_budget < 1:
        raise ConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for prompts within "
            f"model.max_position_embeddings={cfg.model.max_position_embeddings}"
        )
    return cfg


def _validate_run_safety(cfg: TrainConfig) -> None:
    """Checkpoint cadence, resume mode and the non-finite policy."""
    from gspo_megatron.trainer.nonfinite import POLICIES
    from gspo_megatron.trainer.resume_check import validate_allow_list
    from gspo_megatron.trainer.run_dir_owner import resume_mode

    c = cfg.checkpoint
    for name in ("save_every", "keep_last", "export_hf_every"):
        if getattr(c, name) < 0:
            raise ConfigError(f"checkpoint.{name} must be >= 0 (0: {_ZERO_MEANS[name]}), got {getattr(c, name)}")
    try:
        resume_mode(c.resume)
        validate_allow_list(c.resume_allow_changes)
    except RuntimeError as error:
        raise ConfigError(str(error)) from None
    if cfg.trainer.on_nonfinite not in POLICIES:
        raise ConfigError(f"trainer.on_nonfinite={cfg.trainer.on_nonfinite!r} is unknown; valid: {list(POLICIES)}")
    if cfg.trainer.max_consecutive_nonfinite < 1:
        raise ConfigError(
            f"trainer.max_consecutive_nonfinite must be >= 1, got {cfg.trainer.max_consecutive_nonfinite}"
        )


_ZERO_MEANS = {"save_every": "only at the end", "keep_last": "keep all", "export_hf_every": "only at the end"}


def _validate_routed_experts_source(cfg: TrainConfig) -> None:
    """Whatever needs the engine's routed experts needs SGLang launched to return them."""
    if cfg.rollout.engine != "sglang" or cfg.rollout.sglang.enable_return_routed_experts:
        return
    wants = []
    if cfg.rollout.return_routed_experts:
        wants.append("rollout.return_routed_experts=true")
    if cfg.model.is_moe and cfg.routing.enabled and "rollout_vs_train" in cfg.routing.kinds:
        wants.append("routing.kinds contains rollout_vs_train")
    if wants:
        raise ConfigError(
            f"{' and '.join(wants)} needs the engine's routed experts: set "
            "rollout.sglang.enable_return_routed_experts=true (or drop rollout_vs_train from routing.kinds)"
        )
