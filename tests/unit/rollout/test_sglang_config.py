import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_megatron.rollout.sglang.config import SGLangConfig

YAML = Path(__file__).resolve().parents[3] / "gspo_megatron" / "conf" / "rollout" / "sglang.yaml"


def test_yaml_defaults_match_the_dataclass():
    values = OmegaConf.to_container(OmegaConf.load(YAML))["sglang"]
    assert set(values) == {f.name for f in dataclasses.fields(SGLangConfig)}
    # One deliberate difference: the trainer's YAML asks for routed experts, which its default routing
    # diagnostics (rollout_vs_train) need -- start-up validation refuses sglang runs without them.
    assert values.pop("enable_return_routed_experts") is True
    values["model_path"] = "/some/checkpoint"
    built = SGLangConfig(**values)
    reference = SGLangConfig(model_path="/some/checkpoint")
    assert built == reference  # otherwise the YAML repeats the dataclass defaults, no drift


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="remote"), "mode must be one of"),
        (dict(mode="launch"), "needs model_path"),
        (dict(mode="attach"), "needs urls"),
        (dict(mode="attach", urls=["http://x"], weight_sync="nfs"), "weight_sync must be one of"),
        (dict(mode="attach", urls=["http://x"], pause_mode="stop"), "pause_mode must be one of"),
        (dict(model_path="/m", num_servers=2, ports=[1]), "num_servers=2"),
        (dict(mode="attach", urls=["http://x"], max_concurrency=0), "max_concurrency must be >= 1"),
    ],
)
def test_invalid_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SGLangConfig(**kwargs).require_targets()


def test_the_sglang_section_is_required_complete_only_when_sglang_runs():
    """A run on the embedded engine carries an SGLang section it never uses: that run validates; the
    same section refuses to start an sglang run (no model_path to launch, no urls to attach)."""
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.config.store import register_configs
    from gspo_megatron.config.validate import validate_config

    register_configs()
    embedded = to_train_config(compose([]))
    assert embedded.rollout.engine == "embedded" and embedded.rollout.sglang.model_path is None
    validate_config(embedded, 1)
    sglang = to_train_config(compose(["rollout=sglang"]))
    with pytest.raises(ValueError, match="needs model_path"):
        validate_config(sglang, 1)
