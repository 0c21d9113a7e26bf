"""One trigger list for Dynamic Truncated Rollout and step counting (checked at start-up)."""

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


def test_truncated_rollout_rejects_a_step_trigger_list_that_differs():
    with pytest.raises(ConfigError, match=r"shaping.step_grpo.triggers=\['Wait'\].*set them equal"):
        _validate(["rollout.truncated=true", "shaping=step_grpo", "shaping.step_grpo.triggers=[Wait]"])
    with pytest.raises(ConfigError, match="shaping.metrics.triggers"):
        _validate(["rollout.truncated=true", "shaping.metrics.triggers=[Wait]"])


def test_wait_only_is_a_choice_set_in_every_list_together():
    _validate(
        [
            "rollout.truncated=true",
            "shaping=step_grpo",
            "rollout.truncation.trigger_words=[Wait]",
            "shaping.step_grpo.triggers=[Wait]",
            "shaping.metrics.triggers=[Wait]",
        ]
    )
    _validate(["shaping=step_grpo", "shaping.step_grpo.triggers=[Wait]"])  # no rollout probing: free


def test_case_insensitive_step_counting_is_refused_with_truncated_rollout():
    with pytest.raises(ConfigError, match="shaping.step_grpo.case_sensitive=true"):
        _validate(["rollout.truncated=true", "shaping=step_grpo", "shaping.step_grpo.case_sensitive=false"])
