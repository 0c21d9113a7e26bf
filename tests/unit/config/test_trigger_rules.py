"""One trigger list (shaping.trigger_words) for Dynamic Truncated Rollout and step counting."""

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config.compose import compose
from gspo_megatron.config.store import register_configs
from gspo_megatron.config.validate import ConfigError, validate_config

register_configs()


def _validate(overrides):
    base = ["task=reasoning_max_digit", "rollout.max_new_tokens=24"]
    typed = OmegaConf.to_object(compose(base + list(overrides)))
    validate_config(typed, 1)


def test_wait_only_is_one_setting_for_the_probes_and_the_step_count():
    _validate(["rollout.truncated=true", "shaping=step_grpo", "shaping.trigger_words=[Wait]"])
    _validate(["shaping=step_grpo", "shaping.trigger_words=[Wait]"])


def test_case_insensitive_step_counting_is_refused_with_truncated_rollout():
    with pytest.raises(ConfigError, match="shaping.trigger_case_sensitive=true"):
        _validate(["rollout.truncated=true", "shaping=step_grpo", "shaping.trigger_case_sensitive=false"])
    _validate(["shaping=step_grpo", "shaping.trigger_case_sensitive=false"])  # no probing: free
