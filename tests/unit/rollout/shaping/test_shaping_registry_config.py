from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gspo_megatron.rollout.shaping import SHAPERS, ShapingConfig, ShapingGroup, StepGRPOConfig, UnknownNameError
from gspo_megatron.rollout.shaping.identity import no_shaping
from gspo_megatron.rollout.shaping.segmentation import step_counts

TRIGGERS = ["Wait", "Alternatively"]  # shaping.trigger_words


CONF_DIR = Path(__file__).resolve().parents[4] / "gspo_megatron" / "conf" / "shaping"


def test_all_shapers_are_registered_and_duplicates_fail():
    assert set(SHAPERS.names()) == {"none", "step_grpo", "grsp", "dapo_overlong", "kimi_length"}
    with pytest.raises(ValueError, match="already registered"):
        SHAPERS.register("none")(lambda group, cfg: None)
    assert SHAPERS.get("none") is no_shaping
    with pytest.raises(UnknownNameError, match="valid names: dapo_overlong, grsp"):
        SHAPERS.get("overlong")


def test_unknown_shaper_name_lists_valid_names():
    valid = "dapo_overlong, grsp, kimi_length, none, step_grpo"
    with pytest.raises(UnknownNameError, match=f"'step_gpro'; valid names: {valid}"):
        ShapingConfig(name="step_gpro")


def test_shaper_config_is_the_section_of_the_same_name():
    cfg = ShapingConfig(name="step_grpo", step_grpo=StepGRPOConfig(alpha=0.7))
    assert cfg.shaper_config().alpha == 0.7
    assert ShapingConfig(name="none").shaper_config() is None


@pytest.mark.parametrize("path", sorted(CONF_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_yaml_composes_into_the_schema(path):
    text = path.read_text()
    assert text.startswith(f"# python -m gspo_megatron.train shaping={path.stem}\n")
    merged = OmegaConf.merge(OmegaConf.structured(ShapingConfig), OmegaConf.load(path))
    cfg = OmegaConf.to_object(merged)  # runs every __post_init__ validation
    assert isinstance(cfg, ShapingConfig) and cfg.name == path.stem


def test_all_yaml_files_exist():
    assert {p.stem for p in CONF_DIR.glob("*.yaml")} == set(SHAPERS.names())


def test_yaml_values_are_validated():
    override = {"name": "step_grpo", "step_grpo": {"alpha": 1.5}}
    bad = OmegaConf.merge(OmegaConf.structured(ShapingConfig), override)
    with pytest.raises(ValueError, match="alpha"):
        OmegaConf.to_object(bad)


def test_step_grpo_config_validation():
    with pytest.raises(ValueError, match="beta"):
        StepGRPOConfig(beta=1.5)


@pytest.mark.parametrize("words", [[], ["Wait", ""]])
def test_the_trigger_words_must_be_words(words):
    from gspo_megatron.rollout.shaping.config import ShapingConfig

    with pytest.raises(ValueError, match="shaping.trigger_words: trigger words must be a non-empty list"):
        ShapingConfig(trigger_words=words)


def _group_kwargs():
    return dict(
        rewards=torch.tensor([1.0, 0.0]),
        correct=torch.tensor([True, False]),
        format_ok=torch.tensor([True, True]),
        response_texts=["a", "b"],
        steps=step_counts(["a", "b"], TRIGGERS),
        response_lengths=torch.tensor([1, 2]),
        max_response_length=4,
    )


@pytest.mark.parametrize(
    "override, error, message",
    [
        (dict(correct=torch.tensor([1, 0])), TypeError, "correct must be a bool"),
        (dict(rewards=torch.tensor([1, 0])), TypeError, "rewards must be a float"),
        (dict(response_texts=["a"]), ValueError, "response_texts has 1"),
        (dict(response_lengths=torch.tensor([1, 2, 3])), ValueError, "response_lengths has shape"),
        (dict(response_lengths=torch.tensor([1, -2])), ValueError, ">= 0"),
        (dict(max_response_length=0), ValueError, "max_response_length"),
        (dict(token_log_probs=[torch.zeros(1), torch.zeros(3)]), ValueError, r"token_log_probs\[1\]"),
        (dict(rewards=torch.zeros(0)), ValueError, "non-empty"),
    ],
)
def test_group_validation(override, error, message):
    with pytest.raises(error, match=message):
        ShapingGroup(**{**_group_kwargs(), **override})


def test_shaping_warmup_ramps_linearly():
    from gspo_megatron.rollout.shaping.config import ShapingConfig

    ramp = ShapingConfig(name="kimi_length", warmup_steps=4)
    assert [ramp.strength(step) for step in (0, 1, 2, 4, 10)] == [0.0, 0.25, 0.5, 1.0, 1.0]
    assert ShapingConfig(name="kimi_length").strength(0) == 1.0
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        ShapingConfig(warmup_steps=-1)
