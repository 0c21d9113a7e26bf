"""Cross-section validation, once, before anything is built: every rule that needs two sections.

Each section's own rules live with its dataclass (run by ``OmegaConf.to_object``); here are the
rules that relate sections, each raising ``ConfigError`` that names both sides and the fix.
"""

from __future__ import annotations

from gspo_megatron.algorithms.config import validate_algorithm_config
from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.routing.replay import validate_replay_mode


class ConfigError(ValueError):
    pass


def validate_config(cfg: TrainConfig, world_size: int) -> TrainConfig:
    cfg.model.validate()
    validate_algorithm_config(cfg.algorithm)
    cfg.task.validate()
    cfg.tokenizer.validate()
    cfg.reward.validate()
    layout = cfg.parallel.layout(world_size).validate(cfg.model)
    t = cfg.trainer
    for name in ("steps", "prompts_per_step", "updates_per_rollout", "micro_batch_size"):
        if getattr(t, name) < 1:
            raise ConfigError(f"trainer.{name} must be >= 1, got {getattr(t, name)}")
    if t.micro_batch_tokens is not None and t.micro_batch_tokens < 1:
        raise ConfigError(
            f"trainer.micro_batch_tokens must be >= 1 or null (off), got {t.micro_batch_tokens}"
        )
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
    if cfg.rollout.engine not in ("embedded", "sglang"):
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is unknown; valid: embedded, sglang")
    if cfg.rollout.engine == "embedded" and cfg.model.shared_expert_intermediate_size:
        raise ConfigError("the embedded engine (HF Qwen3-MoE) has no shared expert; set model.shared_expert_intermediate_size=0")
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be float32 or bfloat16, got {cfg.model.dtype!r}")
    validate_replay_mode(cfg.algorithm.routing_replay, recompute=t.recompute_activations, pp=layout.pp)
    if cfg.algorithm.routing_replay != "none" and not cfg.model.is_moe:
        raise ConfigError("algorithm.routing_replay needs an MoE model (model.num_experts > 0)")
    if cfg.algorithm.routing_replay == "rollout" and cfg.rollout.engine == "sglang" \
            and not cfg.rollout.sglang.enable_return_routed_experts:
        raise ConfigError(
            "algorithm.routing_replay=rollout (R3) needs the engine's routed experts: set "
            "rollout.sglang.enable_return_routed_experts=true"
        )
    prompt_budget = cfg.model.max_position_embeddings - cfg.rollout.max_new_tokens
    if prompt_budget < 1:
        raise ConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for prompts within "
            f"model.max_position_embeddings={cfg.model.max_position_embeddings}"
        )
    return cfg
