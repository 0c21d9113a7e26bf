"""Cross-section validation, once, before anything is built: every rule that needs two sections.

Each section's own rules live with its dataclass (run by ``OmegaConf.to_object``); here are the
rules that relate sections, each raising ``ConfigError`` that names both sides and the fix.
"""

from __future__ import annotations

import importlib.util

from gspo_megatron.algorithms.config import OldLogProbSource
from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.core.config_node import config_nodes
from gspo_megatron.core.registry import UnknownNameError
from gspo_megatron.policy.config import use_distributed_optimizer
from gspo_megatron.policy.models.config import AttentionKind, LayerSpec
from gspo_megatron.policy.parallel.context_parallel import validate_context_parallel
from gspo_megatron.policy.routing.config import DiagnosticKind
from gspo_megatron.policy.routing.replay import validate_replay_mode
from gspo_megatron.policy.routing.replay_strategy import needs_engine_routing, needs_trainer_old_pass, replays
from gspo_megatron.rollout.agents.toolkit import load_user_tools
from gspo_megatron.rollout.agents.tools.user_tools import UserToolError
from gspo_megatron.rollout.config import InflightUpdateMode, RolloutEngineName
from gspo_megatron.rollout.engines import ENGINES, EngineNeeds
from gspo_megatron.rollout.shaping.triggers import check_probing_triggers


class ConfigError(ValueError):
    pass


def validate_config(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Every section's own rules (``ConfigNode.validate``, again: fields may have been set since
    construction), then the rules that span sections."""
    for node in config_nodes(cfg):
        try:
            node.validate()
        except ValueError as error:
            if type(error) is not ValueError:  # a section's own error type (ModelConfigError, ...) stays
                raise
            raise ConfigError(str(error)) from None
    layout = cfg.parallel.layout(world_size).validate(cfg.model)
    validate_context_parallel(layout.cp, cfg.model.max_position_embeddings)
    t = cfg.trainer
    if t.eval_samples > 1 and cfg.rollout.eval_temperature == 0:
        raise ConfigError(
            f"trainer.eval_samples={t.eval_samples} with greedy decoding (rollout.eval_temperature=0) gives "
            "k identical samples; set rollout.eval_temperature > 0 or trainer.eval_samples=1"
        )
    if cfg.rollout.over_sample > 1 and cfg.algorithm.dynamic_sampling.enabled:
        raise ConfigError(
            f"rollout.over_sample={cfg.rollout.over_sample} with algorithm.dynamic_sampling.enabled=true: both "
            "decide which groups a step trains and are not combined here; set one of them off"
        )
    if cfg.rollout.async_rollout and cfg.rollout.max_staleness > 1 and cfg.algorithm.dynamic_sampling.enabled:
        raise ConfigError(
            f"rollout.max_staleness={cfg.rollout.max_staleness} (streaming) with "
            "algorithm.dynamic_sampling.enabled=true: the producer's rounds are one step's prompts each and "
            "dynamic sampling's extra rounds are not streamed; set algorithm.dynamic_sampling.enabled=false or "
            "rollout.max_staleness=1"
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
    micro_batches = -(-per_rank // t.micro_batch_size)
    if layout.vpp > 1 and t.micro_batch_tokens is None and micro_batches < layout.pp:
        raise ConfigError(  # token budgets decide the count per batch: policy/models/schedule.py checks those
            f"parallel.vpp={layout.vpp}: megatron's interleaved 1F1B needs at least pp = {layout.pp} micro-batches "
            f"per call, each data-parallel rank has {micro_batches} ({per_rank} sequences / "
            f"trainer.micro_batch_size={t.micro_batch_size}); lower trainer.micro_batch_size or set parallel.vpp=1"
        )
    _validate_engine(cfg)
    _validate_agent(cfg)
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be float32 or bfloat16, got {cfg.model.dtype!r}")
    _validate_old_policy_source(cfg)
    _validate_shared_prefix(cfg, layout)
    _validate_optimizer_offload(cfg, layout)
    if t.reference_offload and cfg.algorithm.kl.coef == 0:
        raise ConfigError(
            "trainer.reference_offload=true but algorithm.kl.coef=0 builds no reference model; "
            "set algorithm.kl.coef > 0 or trainer.reference_offload=false"
        )
    if (
        cfg.routing.enabled
        and DiagnosticKind.ratio_decomposition in cfg.routing.kinds
        and cfg.trainer.old_log_probs == OldLogProbSource.rollout
    ):
        raise ConfigError(
            "routing.kinds contains ratio_decomposition, which replays the old-log-prob pass's routing, but "
            "trainer.old_log_probs=rollout skips that pass; set trainer.old_log_probs=trainer or drop "
            "ratio_decomposition from routing.kinds"
        )
    validate_replay_mode(cfg.routing.replay, recompute=t.recompute_activations, pp=layout.pp)
    if replays(cfg.routing.replay) and not cfg.model.is_moe:
        raise ConfigError("routing.replay needs an MoE model (model.num_experts > 0)")
    if cfg.rollout.truncated:
        try:
            check_probing_triggers(cfg.shaping)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if cfg.rollout.truncation.train_on_exit_tokens and (
            cfg.trainer.old_log_probs == OldLogProbSource.rollout or cfg.algorithm.mismatch.active
        ):
            raise ConfigError(
                "rollout.truncation.train_on_exit_tokens=true trains on tokens the engine did not sample "
                f"and has no log-prob for, so trainer.old_log_probs={cfg.trainer.old_log_probs!s} / "
                f"algorithm.mismatch.correction={cfg.algorithm.mismatch.correction!s} (or algorithm.mismatch.reject / "
                "veto) cannot use the engine's log-probs for them: set trainer.old_log_probs=trainer "
                "and algorithm.mismatch.correction=none (reject=none, veto=null), "
                "or leave train_on_exit_tokens=false"
            )
    if cfg.prompt_token_budget() < 1:
        key, tokens = cfg.rollout.response_budget()
        raise ConfigError(
            f"{key}={tokens} leaves no room for prompts within "
            f"model.max_position_embeddings={cfg.model.max_position_embeddings}"
        )
    return cfg


def _validate_agent(cfg: TrainConfig) -> None:
    """A user's tools (``rollout.agent.tools``: imported, built once, checked, names told apart) and per-turn
    advantages, before the run directory is claimed."""
    if cfg.rollout.agent.enabled:
        try:
            load_user_tools(cfg.rollout.agent)
        except UserToolError as error:
            raise ConfigError(str(error)) from error
        embedded = cfg.rollout.engine == RolloutEngineName.embedded
        if embedded and cfg.rollout.embedded.use_cache and cfg.model.linear_attention_layers:
            # the engine's sessions keep a trajectory's attention KV between turns, not a gated DeltaNet
            # layer's recurrent state (rollout/embedded/kv_cache.py: KeptCache)
            raise ConfigError(
                f"rollout.agent.name={cfg.rollout.agent.name} with a hybrid model (model.linear_attention_layers="
                f"{list(cfg.model.linear_attention_layers)}): the embedded engine keeps a trajectory's attention "
                "cache between turns but not its linear-attention layers' recurrent state; set "
                "rollout.embedded.use_cache=false (each turn computes the whole trajectory again)"
            )
    elif cfg.algorithm.advantage.turn_reward_weight > 0:
        raise ConfigError(
            f"algorithm.advantage.turn_reward_weight={cfg.algorithm.advantage.turn_reward_weight} weighs per-turn "
            "rewards, which only multi-turn trajectories have, but rollout.agent.name=none; set an agent "
            "(docs/agents.md) or turn_reward_weight=0"
        )


def _validate_old_policy_source(cfg: TrainConfig) -> None:
    """trainer.old_log_probs=rollout (pi_old = the engine's log-probs) against what needs the trainer's pass."""
    if cfg.trainer.old_log_probs != OldLogProbSource.rollout:
        return
    if needs_trainer_old_pass(cfg.routing.replay):
        raise ConfigError(
            "trainer.old_log_probs=rollout skips the trainer's old-policy forward, but "
            "routing.replay=old_policy replays the routing recorded in exactly that forward; use "
            "routing.replay=rollout (R3: the engine's routing, which produced the engine's log-probs) "
            "or none, or set trainer.old_log_probs=trainer"
        )
    mismatch = cfg.algorithm.mismatch
    if mismatch.active:
        raise ConfigError(
            f"algorithm.mismatch.correction={mismatch.correction} / reject={mismatch.reject} / "
            f"veto={mismatch.veto} use pi_old / pi_rollout, which is exactly 1 when trainer.old_log_probs=rollout "
            "takes pi_old from the engine; turn them off or set trainer.old_log_probs=trainer"
        )


def validate_for_machine(cfg: TrainConfig) -> None:
    """Rules that depend on this machine, not on the config alone (run at start-up, after ``validate_config``)."""
    for key, package in (("logging.wandb", "wandb"), ("logging.tensorboard", "tensorboard")):
        if getattr(cfg.logging, key.split(".")[1]) and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{key}=true but the {package} package is not installed here; install it, or set {key}=false"
            )


def _validate_shared_prefix(cfg: TrainConfig, layout) -> None:
    """``trainer.shared_prefix=true``: what its packed forward cannot serve (``contracts/shared_prefix.py``,
    ``policy/models/shared_prefix_forward.py``); the portable core attention is checked on the built model."""
    if not cfg.trainer.shared_prefix:
        return
    model = cfg.model
    refusals = [
        (replays(cfg.routing.replay), f"routing.replay={cfg.routing.replay} (replay targets are in the row layout)"),
        (
            cfg.routing.enabled and DiagnosticKind.ratio_decomposition in cfg.routing.kinds,
            "routing.kinds with ratio_decomposition (it replays the old pass's routing, kept in the row layout)",
        ),
        (layout.cp > 1, f"parallel.cp={layout.cp} (the packed rows are not split over context-parallel ranks)"),
        (layout.pp > 1, f"parallel.pp={layout.pp} (the gather back to rows runs on the last stage only)"),
        (
            bool(model.linear_attention_layers),
            f"model.linear_attention_layers={list(model.linear_attention_layers)} (linear attention sees every "
            "earlier token of the packed row)",
        ),
        (model.attention == AttentionKind.mla, "model.attention=mla (its RoPE is applied apart)"),
        (model.rope_yarn, "model.rope_yarn=true (YaRN's rotary module is not hooked)"),
        (
            model.router_aux_loss_coef > 0,
            f"model.router_aux_loss_coef={model.router_aux_loss_coef} (the load-balancing loss counts the fed tokens: "
            "a shared prompt once, not once per row)",
        ),
        (
            model.expert_bias_update_rate > 0,
            f"model.expert_bias_update_rate={model.expert_bias_update_rate} (the expert-bias update counts the fed "
            "tokens: a shared prompt once, not once per row)",
        ),
        (model.layer_spec == LayerSpec.te, "model.layer_spec=te (TransformerEngine's attention ignores the mask)"),
        (
            layout.use_sequence_parallel and cfg.routing.enabled,
            "sequence parallelism with routing.enabled=true (each rank routes a slice of the packed tokens, "
            "which the routing recordings cannot put back in row order)",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise ConfigError(
                f"trainer.shared_prefix=true cannot serve {what}; "
                "set trainer.shared_prefix=false or change that setting"
            )


def _validate_optimizer_offload(cfg: TrainConfig, layout) -> None:
    """megatron-core's HybridDeviceOptimizer runs only inside its distributed optimizer and on the fp32 main
    copies of bf16 weights: the distributed optimizer hands it views of fp32 weights, which torch refuses
    ("can't optimize a non-leaf Tensor", ``distrib_optimizer.py:420`` in 0.16.1), and the plain
    mixed-precision optimizer's step fails inside it (seen on 2 gloo ranks). megatron's precision-aware
    optimizer asserts the distributed optimizer and exists for bf16 weights (``optimizer_config.py``).
    Its need for TransformerEngine's FusedAdam without offload is a property of the machine, checked
    where the optimizer is built (``policy/optimizer.py``), so a plan made on a laptop is not refused."""
    for key in ("cpu_offload", "precision_aware"):
        if getattr(cfg.optimizer, key):
            _offload_needs_bf16_and_distributed(cfg, layout, f"optimizer.{key}")
    reduced = cfg.optimizer.reduced_state_dtypes
    if reduced and (not cfg.optimizer.precision_aware or cfg.optimizer.cpu_offload):
        settings = " ".join(f"optimizer.{key}={getattr(cfg.optimizer, key)}" for key in reduced)
        raise ConfigError(
            f"{settings}: reduced optimizer state lives in TransformerEngine's FusedAdam, megatron's precision-aware "
            "optimizer on the device; it needs optimizer.precision_aware=true and optimizer.cpu_offload=false "
            "(the host optimizer keeps float32 state); set those, or the state dtypes back to float32"
        )


def _offload_needs_bf16_and_distributed(cfg: TrainConfig, layout, key: str) -> None:
    if cfg.model.dtype != "bfloat16":
        raise ConfigError(
            f"{key}=true needs model.dtype=bfloat16 (got {cfg.model.dtype}): megatron's host and precision-aware "
            "optimizers step fp32 master copies of bf16 weights; set model.dtype=bfloat16"
        )
    if not use_distributed_optimizer(cfg.optimizer.distributed, layout):
        raise ConfigError(
            f"{key}=true needs megatron's distributed optimizer (optimizer.distributed="
            f"{cfg.optimizer.distributed} resolves to off here): set optimizer.distributed=true"
        )


def _validate_engine(cfg: TrainConfig) -> None:
    """What the run needs of its engine (the routed experts, colocation), answered by the engine itself
    (``rollout/engines.py``), before the model is built."""
    try:
        spec = ENGINES.get(cfg.rollout.engine)
    except UnknownNameError:
        raise ConfigError(
            f"rollout.engine={cfg.rollout.engine!r} is unknown; valid: {', '.join(ENGINES.names())}"
        ) from None
    wants = []
    if cfg.rollout.return_routed_experts:
        wants.append("rollout.return_routed_experts=true")
    if cfg.model.is_moe and cfg.routing.enabled and DiagnosticKind.rollout_vs_train in cfg.routing.kinds:
        wants.append("routing.kinds contains rollout_vs_train")
    _refuse_retract_with_routing(cfg)
    needs = EngineNeeds(
        routed_experts=wants,
        replays_engine_routing=needs_engine_routing(cfg.routing.replay),
        placement=cfg.rollout.placement,
    )
    try:
        spec.check(cfg.rollout, needs)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _refuse_retract_with_routing(cfg: TrainConfig) -> None:
    """A ``retract`` update ends each row whose routing the new weights change (``ABORT``, ``engine.py``): one
    routing row per position cannot hold both versions'. Where the engine returns an MoE's routing (R3, a
    routing diagnostic: ``loop/build.py:rollout_settings``) that would cut responses short by whether the policy
    moved their routing, a bias no loss corrects; refused rather than trained."""
    if cfg.rollout.inflight_update_mode != InflightUpdateMode.retract or not cfg.model.is_moe:
        return
    wants = {
        "rollout.return_routed_experts=true": cfg.rollout.return_routed_experts,
        f"routing.replay={cfg.routing.replay}": needs_engine_routing(cfg.routing.replay),
        "routing.kinds contains rollout_vs_train": DiagnosticKind.rollout_vs_train in cfg.routing.kinds,
    }
    if any(wants.values()):
        raise ConfigError(
            f"rollout.inflight_update_mode=retract with {', '.join(k for k, on in wants.items() if on)}: a retract "
            "update ends every row whose routing the new weights change (its routing rows cannot hold both "
            "versions'), cutting responses short by routing; set rollout.inflight_update_mode=in_place (the KV "
            "cache and each position's routing row kept: R3 exact) or off, or return no routing"
        )
