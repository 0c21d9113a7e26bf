"""Start-up rules that used to fail late (at step 1, or deep in megatron) or not at: each names its key."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from gspo_megatron.config.compose import compose
from gspo_megatron.config.validate import ConfigError, validate_config


def _typed(overrides):
    return OmegaConf.to_object(compose(list(overrides)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        # 4 prompts x 4 responses / 2 updates = 8 rows per rank; 3 does not divide 8
        (
            ["trainer.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=3"],
            r"trainer.micro_batch_size=3 does not divide the 8 sequences",
        ),
        (
            ["rollout=sglang", "rollout.sglang.model_path=/ckpt", "rollout.sglang.enable_return_routed_experts=false"],
            r"routing.kinds contains rollout_vs_train needs .*enable_return_routed_experts=true",
        ),
        (["checkpoint.save_every=-1"], r"checkpoint.save_every must be >= 0"),
        (["checkpoint.keep_last=-2"], r"checkpoint.keep_last must be >= 0"),
        (["checkpoint.resume=maybe"], r"checkpoint.resume='maybe'"),
        (["checkpoint.resume_allow_changes=[model.hidden_size]"], r"shape cannot change"),
        (["trainer.max_consecutive_nonfinite=0"], r"trainer.max_consecutive_nonfinite must be >= 1"),
    ],
    ids=[
        "micro_batch",
        "sglang_routed_experts",
        "save_every",
        "keep_last",
        "resume",
        "allow_model",
        "max_consecutive",
    ],
)
def test_bad_value_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_typed(overrides), 1)


@pytest.mark.parametrize(
    "key, choices",
    [
        ("algorithm.routing_replay", "none, old_policy, rollout"),
        ("algorithm.old_log_probs", "trainer, rollout"),
        ("algorithm.mismatch_correction", "none, token_truncate, token_mask, sequence_truncate, sequence_mask"),
        ("algorithm.aggregation", "seq_mean_token_mean, token_mean, seq_mean_token_sum"),
        ("rollout.engine", "embedded, sglang"),
        ("rollout.embedded.dtype", "float32, bfloat16, float16"),
        ("rollout.embedded.attn_implementation", "sdpa, eager"),
        ("model.dtype", "float32, bfloat16"),
        ("model.layer_spec", "auto, te, portable"),
        ("optimizer.decay_style", "constant, linear, cosine"),
        ("trainer.on_nonfinite", "skip, stop"),
    ],
)
def test_closed_choices_fail_at_compose_time_naming_the_key_and_the_choices(key, choices):
    with pytest.raises(ConfigCompositionException) as failure:
        compose([f"{key}=bogus"])
    cause = str(failure.value.__cause__)
    assert f"Invalid value 'bogus', expected one of [{choices}]" in cause and f"full_key: {key}" in cause


def test_micro_batch_rules_that_hold():
    validate_config(_typed(["trainer.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4"]), 1)
    validate_config(_typed(["trainer.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=32"]), 1)
    validate_config(_typed(["rollout=sglang", "rollout.sglang.model_path=/ckpt"]), 1)  # the YAML default holds


def test_bfloat16_is_accepted_on_any_machine():
    validate_config(_typed(["model.dtype=bfloat16"]), 1)  # megatron's bf16 optimizer runs on CPU too


@pytest.mark.parametrize("given, resolved", [("auto", "auto"), ("true", "true"), ("False", "false")])
def test_distributed_optimizer_choice(given, resolved):
    assert validate_config(_typed([f"optimizer.distributed={given}"]), 1).optimizer.distributed == resolved


def test_distributed_optimizer_choice_refuses_other_values():
    with pytest.raises(ValueError, match="optimizer.distributed='sometimes' is not one of auto, true, false"):
        _typed(["optimizer.distributed=sometimes"])
