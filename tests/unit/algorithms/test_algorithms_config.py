"""AlgorithmConfig: presets state only what they change and compose onto the schema; validation errors
name the nested key and the fix."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_megatron.algorithms import AlgorithmConfig, LossConfig, LossContext
from gspo_megatron.algorithms.config import (
    RECOMMENDED_CLIP,
    AdvantageConfig,
    DynamicSamplingConfig,
    KLConfig,
    MismatchConfig,
)
from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config
from gspo_megatron.core.config_node import flatten_dotted

CONF = Path(__file__).resolve().parents[3] / "gspo_megatron" / "conf" / "algorithm"


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_base_presets_compose_onto_the_schema_and_validate(name):
    path = CONF / f"{name}.yaml"
    assert path.read_text().startswith("# ") and "python -m gspo_megatron.train algorithm=" in path.read_text()
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), OmegaConf.load(path)))
    cfg.validate()
    assert (cfg.name, cfg.loss.name) == (name, name)
    assert (cfg.loss.clip_low, cfg.loss.clip_high) == RECOMMENDED_CLIP[name]


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_preset_states_only_what_it_changes(path):
    """A value equal to what the preset would get without it (its base preset's, else the schema's) is a
    restatement: a later default change would not reach the preset, and the file hides what it changes."""
    raw = OmegaConf.to_container(OmegaConf.load(path))
    package_global = path.read_text().startswith("# @package _global_")
    stated = flatten_dotted(raw if package_global else {"algorithm": raw})
    bases = [d for d in stated.pop("defaults", []) if d != "_self_"]
    base_overrides = [f"algorithm={bases[0].split('/')[-1].split('@')[0]}"] if bases else []
    without = flatten_dotted(OmegaConf.to_container(compose(base_overrides)))
    restated = {k: v for k, v in stated.items() if k != "algorithm.name" and without.get(k) == v}
    assert not restated, f"{path.name} restates {restated}: state only what the preset changes"
    assert to_train_config(compose([f"algorithm={path.stem}"])).algorithm.name == path.stem


def test_defaults_are_gspo_paper_values():
    loss = AlgorithmConfig().loss
    assert (loss.name, loss.clip_low, loss.clip_high, loss.aggregation) == ("gspo", 3e-4, 4e-4, "seq_mean_token_mean")


@pytest.mark.parametrize(
    "build,message",
    [
        (
            lambda: LossConfig(name="ppo"),
            r"algorithm.loss.name='ppo' is not a policy loss; valid: grpo, gspo, gspo_token",
        ),
        (
            lambda: AdvantageConfig(estimator="gae"),
            r"algorithm.advantage.estimator='gae' is unknown; valid: group_relative",
        ),
        (lambda: LossConfig(aggregation="mean"), r"valid: seq_mean_token_mean"),
        (
            lambda: LossConfig(aggregation="token_mean"),
            r"length bias; set algorithm.loss.aggregation=seq_mean_token_mean",
        ),
        (lambda: LossConfig(log_ratio_clamp=0.0), r"algorithm.loss.log_ratio_clamp must be > 0"),
        (lambda: LossConfig(name="grpo", clip_low=1.2), r"algorithm.loss.clip_low must be in \[0, 1\)"),
        (lambda: LossConfig(clip_high=-0.1), r"algorithm.loss.clip_high must be >= 0"),
        (lambda: LossConfig(opsm_delta=-1.0), r"algorithm.loss.opsm_delta must be >= 0"),
        (lambda: KLConfig(coef=-0.1), r"algorithm.kl.coef must be >= 0"),
        (lambda: KLConfig(estimator="k9"), r"algorithm.kl.estimator='k9' is unknown"),
        (lambda: MismatchConfig(cap=0.5), r"algorithm.mismatch.cap must be >= 1"),
        (
            lambda: DynamicSamplingConfig(max_extra_rounds=-1),
            r"algorithm.dynamic_sampling.max_extra_rounds must be >= 0",
        ),
        (
            lambda: AlgorithmConfig(mismatch=MismatchConfig(correction="token_truncate")),
            r"algorithm.mismatch.correction=token_truncate gives per-token weights, but algorithm.loss.name=gspo",
        ),
    ],
)
def test_validation_errors_name_the_nested_key(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_grpo_allows_token_mean_and_the_loss_context_is_the_section_plus_denominators():
    loss = LossConfig(name="grpo", clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    ctx = LossContext(loss, global_num_sequences=8, global_num_tokens=100)
    assert ctx.loss is loss  # the section itself, not a copy of its fields
    assert (ctx.clip_low, ctx.clip_high, ctx.loss.aggregation, ctx.global_num_tokens) == (0.2, 0.28, "token_mean", 100)
