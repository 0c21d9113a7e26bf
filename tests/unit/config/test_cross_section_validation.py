"""``config.validate.validate_config``: each cross-section rule (layout vs world and model, batch
sizes vs data parallelism, engine vs model, replay vs engine/model/schedule) refuses the bad
combination with a message naming both sides; the default config and the shipped layouts pass."""

from __future__ import annotations

import pytest

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import TrainConfig, to_train_config
from gspo_megatron.config.validate import ConfigError, validate_config
from gspo_megatron.policy.models.config import ModelConfigError
from gspo_megatron.policy.parallel.layout import LayoutError


def refused(cfg: TrainConfig, world: int, *fragments: str, error=ConfigError) -> str:
    with pytest.raises(error) as info:
        validate_config(cfg, world)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_default_config_is_valid_on_one_rank():
    cfg = TrainConfig()
    assert validate_config(cfg, 1) is cfg


@pytest.mark.parametrize(
    "parallel, world",
    [
        (dict(tp=2), 2),
        (dict(pp=2), 2),
        (dict(ep=2), 2),
        (dict(tp=2, ep=2), 4),
        (dict(), 4),
        (dict(cp=2), 2),
        (dict(tp=2, cp=2), 4),
        (dict(cp=2, ep=2), 2),
        (dict(pp=2, cp=2), 4),
    ],
)
def test_test_layouts_are_valid(parallel, world):
    cfg = TrainConfig()
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    validate_config(cfg, world)


# --- sections' own rules run first ---------------------------------------------------------------
def test_model_rules_run():
    cfg = TrainConfig()
    cfg.model.num_kv_heads = 3
    refused(cfg, 1, "num_kv_heads = 3", error=ModelConfigError)


# --- layout vs world size and model -------------------------------------------------------------
def test_layout_must_fit_the_world_size():
    cfg = TrainConfig()
    cfg.parallel.tp = 2
    refused(cfg, 3, "2*1*1 = 2", "world size 3", error=LayoutError)


def test_layout_must_fit_the_model():
    cfg = TrainConfig()
    cfg.parallel.ep = 3  # 4 experts
    refused(cfg, 3, "model.num_experts = 4", "parallel.ep = 3", error=LayoutError)


def test_context_parallel_needs_positions_divisible_by_two_cp():
    cfg = TrainConfig()
    cfg.parallel.cp = 2
    cfg.model.max_position_embeddings = 250  # rows are padded to a multiple of 2*cp = 4
    refused(cfg, 2, "parallel.cp=2", "model.max_position_embeddings=250", "multiple of 4", error=LayoutError)


def test_layout_sequence_parallel_rule_reaches_validate_config():
    cfg = TrainConfig()
    cfg.parallel.tp, cfg.parallel.sequence_parallel = 2, False
    refused(cfg, 2, "sequence_parallel=true", error=LayoutError)


# --- trainer sizes ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["steps", "prompts_per_step", "updates_per_rollout", "micro_batch_size"])
def test_trainer_counts_must_be_positive(name):
    cfg = TrainConfig()
    setattr(cfg.trainer, name, 0)
    refused(cfg, 1, f"trainer.{name} must be >= 1", "got 0")


def test_groups_need_two_responses():
    cfg = TrainConfig()
    cfg.rollout.group_size = 1
    refused(cfg, 1, "rollout.group_size=1", ">= 2")


def test_rollout_must_split_into_mini_batches():
    cfg = TrainConfig()
    cfg.trainer.prompts_per_step, cfg.rollout.group_size, cfg.trainer.updates_per_rollout = 3, 5, 2
    refused(cfg, 1, "= 15", "updates_per_rollout = 2")


def test_mini_batch_must_split_over_data_parallel_ranks():
    cfg = TrainConfig()
    cfg.trainer.prompts_per_step, cfg.rollout.group_size, cfg.trainer.updates_per_rollout = 3, 4, 2
    # 12 sequences, 2 mini-batches of 6; world 4 with tp=1 -> dp=4 does not divide 6
    refused(cfg, 4, "6 sequences", "data-parallel size 4", "world 4")
    # tp=2 on the same 4 ranks -> dp=2 divides 6
    cfg.parallel.tp = 2
    validate_config(cfg, 4)


# --- engine vs model ----------------------------------------------------------------------------
def test_unknown_engine():
    cfg = TrainConfig()
    cfg.rollout.engine = "vllm"
    refused(cfg, 1, "'vllm'", "embedded, sglang")


def test_a_shared_expert_needs_a_family_that_has_one():
    """Neither engine serves, and no HF checkpoint holds, a shared expert the architecture lacks."""
    cfg = TrainConfig()
    cfg.model.shared_expert_intermediate_size = 32
    for engine in ("embedded", "sglang"):
        cfg.rollout.engine = engine
        cfg.rollout.sglang.enable_return_routed_experts = True  # what the default diagnostics need
        cfg.rollout.sglang.model_path = "/ckpt"  # what the engine launches
        refused(cfg, 1, "Qwen3-MoE architecture has no shared expert", "qwen2_moe", error=ModelConfigError)
    cfg.model.family, cfg.model.qk_norm, cfg.model.qkv_bias = "qwen2_moe", False, True
    validate_config(cfg, 1)


def test_dtype():
    cfg = TrainConfig()
    cfg.model.dtype = "float16"
    refused(cfg, 1, "model.dtype", "'float16'")


def test_prompt_budget_within_max_positions():
    cfg = TrainConfig()
    cfg.model.max_position_embeddings, cfg.rollout.max_new_tokens = 64, 64
    refused(cfg, 1, "max_new_tokens=64", "max_position_embeddings=64")
    cfg.rollout.max_new_tokens = 63
    validate_config(cfg, 1)


# --- routing replay -----------------------------------------------------------------------------
def test_unknown_replay_mode():
    cfg = TrainConfig()
    cfg.routing.replay = "always"
    with pytest.raises(ValueError, match=r"'always'.*none, old_policy, rollout"):
        validate_config(cfg, 1)


def test_replay_with_recompute_needs_single_stage():
    cfg = TrainConfig()
    cfg.routing.replay, cfg.trainer.recompute_activations, cfg.parallel.pp = "old_policy", True, 2
    with pytest.raises(ValueError, match="pp=1"):
        validate_config(cfg, 2)
    cfg.parallel.pp = 1
    validate_config(cfg, 1)


def test_replay_needs_an_moe_model():
    cfg = TrainConfig()
    cfg.routing.replay = "old_policy"
    cfg.model.num_layers, cfg.model.dense_layers, cfg.model.dense_intermediate_size = 2, [0, 1], 64
    refused(cfg, 1, "routing.replay needs an MoE model")


def test_rollout_replay_with_sglang_needs_routed_experts():
    cfg = TrainConfig()
    cfg.routing.replay, cfg.rollout.engine = "rollout", "sglang"
    cfg.rollout.sglang.model_path = "/ckpt"
    refused(cfg, 1, "enable_return_routed_experts=true")
    cfg.rollout.sglang.enable_return_routed_experts = True
    validate_config(cfg, 1)


# pi_old's source (trainer.old_log_probs) against the algorithm's and routing's sections
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.logprob_chunk_size=0"], r"trainer.logprob_chunk_size must be >= 1"),
        (
            ["trainer.old_log_probs=rollout", "algorithm=grpo_routing_replay"],
            r"skips the trainer's old-policy forward.*use routing.replay=rollout",
        ),
        (
            ["trainer.old_log_probs=rollout", "algorithm=grpo_tis"],
            r"exactly 1 when trainer.old_log_probs=rollout",
        ),
    ],
)
def test_rules_across_sections(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        validate_config(to_train_config(compose(overrides)), world_size=1)


@pytest.mark.parametrize("algorithm", ["grpo", "grpo_rollout_routing_replay"])
def test_engine_old_log_probs_allowed_without_old_policy_replay(algorithm):
    validate_config(to_train_config(compose([f"algorithm={algorithm}", "trainer.old_log_probs=rollout"])), 1)


# --- trainer.shared_prefix: what its packed forward cannot serve ---------------------------------
def _shared_prefix(**changes) -> TrainConfig:
    cfg = TrainConfig()
    cfg.trainer.shared_prefix = True
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def test_shared_prefix_on_the_default_config_is_valid():
    validate_config(_shared_prefix(), 1)


@pytest.mark.parametrize(
    "changes, world, fragment",
    [
        (dict(routing__replay="old_policy"), 1, "routing.replay=old_policy"),
        (dict(routing__replay="rollout"), 1, "routing.replay=rollout"),
        (dict(routing__kinds=["update", "ratio_decomposition"]), 1, "ratio_decomposition"),
        (dict(parallel__cp=2), 2, "parallel.cp=2"),
        (dict(parallel__pp=2), 2, "parallel.pp=2"),
        (dict(model__layer_spec="te"), 1, "model.layer_spec=te"),
        (dict(model__router_aux_loss_coef=0.01), 1, "model.router_aux_loss_coef=0.01"),
        (dict(parallel__tp=2), 2, "sequence parallelism with routing.enabled=true"),
    ],
)
def test_shared_prefix_refuses_what_it_cannot_serve(changes, world, fragment):
    refused(
        _shared_prefix(**changes),
        world,
        "trainer.shared_prefix=true cannot serve",
        fragment,
        "trainer.shared_prefix=false",
    )


def test_shared_prefix_refuses_mla_and_linear_attention():
    cfg = to_train_config(compose(["model=deepseek_v3_tiny", "trainer.shared_prefix=true"]))
    refused(cfg, 1, "model.attention=mla")
    cfg = to_train_config(compose(["model=qwen3_next_tiny", "trainer.shared_prefix=true"]))
    refused(cfg, 1, "model.linear_attention_layers=")


def test_shared_prefix_with_tensor_parallelism_and_no_routing_diagnostics_is_valid():
    validate_config(_shared_prefix(parallel__tp=2, routing__enabled=False), 2)
