"""YaRN RoPE scaling in the model config (``policy/models/config.py``): read from and written to config.json as
transformers reads it, refused by name where megatron's YaRN would compute something else. That megatron's
forward then equals transformers': ``tests/distributed/test_engine_matches_megatron.py`` (``+yarn``), under
TP and CP: ``tests/distributed/test_model_layouts.py::test_yarn_rope_layout_matches_single_rank``."""

from __future__ import annotations

import pytest

from gspo_megatron.policy.models.config import ModelConfigError, MoEModelConfig
from gspo_megatron.testing.model_fixtures import YARN_TEST_OVERRIDES, tiny_family_config, tiny_yarn_config

YARN_KEYS = (
    "rope_yarn_factor",
    "rope_yarn_original_max_position_embeddings",
    "rope_yarn_beta_fast",
    "rope_yarn_beta_slow",
    "rope_yarn_mscale",
    "rope_yarn_mscale_all_dim",
)


def _yarn_of(cfg: MoEModelConfig) -> tuple:
    return tuple(getattr(cfg, key) for key in YARN_KEYS)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "qwen2_moe"])
def test_yarn_round_trips_through_transformers_config(family):
    cfg = tiny_yarn_config(family)
    hf = cfg.to_hf_config()  # transformers' own config class reads the keys
    rope = hf.rope_parameters
    assert rope["rope_type"] == "yarn"
    assert (rope["factor"], rope["original_max_position_embeddings"]) == (4.0, 16)
    assert (rope["beta_fast"], rope["beta_slow"], rope["mscale"], rope["mscale_all_dim"]) == (8.0, 0.25, 2.0, 1.0)
    back = MoEModelConfig.from_hf_dict(hf.to_dict())  # transformers >= 5 writes rope_parameters
    assert _yarn_of(back) == _yarn_of(cfg)
    assert MoEModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg  # and rope_scaling, as older ones read it


def test_plain_rope_writes_no_scaling():
    cfg = tiny_family_config("qwen3_moe")
    assert not cfg.rope_yarn and "rope_scaling" not in cfg.to_hf_dict()
    assert cfg.to_hf_config().rope_parameters["rope_type"] == "default"


def test_qwen_style_yarn_reads_transformers_defaults():
    """Qwen3's long-context recipe gives only type, factor and the original context: betas 32 / 1 and the
    cos/sin factor m(1) = 0.1 ln(factor) + 1, which mscale 1 / mscale_all_dim 0 make in megatron."""
    hf = tiny_family_config("qwen3_moe").to_hf_dict() | {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    }
    assert _yarn_of(MoEModelConfig.from_hf_dict(hf)) == (4.0, 32, 32.0, 1.0, 1.0, 0.0)


def test_an_mscale_without_mscale_all_dim_is_read_as_transformers_uses_it():
    """transformers takes m(mscale) / m(mscale_all_dim) only when both are non-zero, else m(1)."""
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.7}
    hf = tiny_family_config("qwen3_moe").to_hf_dict() | {"rope_scaling": scaling}
    cfg = MoEModelConfig.from_hf_dict(hf)
    assert (cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim) == (1.0, 0.0)


def test_a_missing_factor_is_the_context_ratio():
    """transformers (DeepSeek's convention): factor = max_position_embeddings / original."""
    hf = tiny_family_config("qwen3_moe", max_position_embeddings=128).to_hf_dict()
    hf["rope_scaling"] = {"type": "yarn", "original_max_position_embeddings": 32}
    assert MoEModelConfig.from_hf_dict(hf).rope_yarn_factor == 4.0


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "linear", "factor": 2.0}, r"RoPE scaling of type 'linear'; only YaRN"),
        ({"rope_type": "yarn", "factor": 2.0, "truncate": False}, r"truncate=False.*remove the key"),
        ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.2}, r"attention_factor=1\.2"),
    ],
)
def test_what_megatron_cannot_build_is_refused_when_read(scaling, message):
    hf = tiny_family_config("qwen3_moe").to_hf_dict() | {"rope_scaling": scaling}
    with pytest.raises(ModelConfigError, match=message):
        MoEModelConfig.from_hf_dict(hf)


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("qwen3_moe", dict(rope_yarn_factor=0.5), r"model\.rope_yarn_factor=0\.5 must be >= 1"),
        ("glm4_moe", dict(rope_yarn_factor=4.0), r"model\.rotary_fraction=0\.5.*set model\.rotary_fraction=1\.0"),
        ("qwen3_moe", dict(rope_yarn_beta_slow=0.0), r"model\.rope_yarn_beta_slow must be > 0"),
        ("qwen3_moe", dict(rope_yarn_mscale_all_dim=0.0), r"rope_yarn_mscale=2\.0.*set model\.rope_yarn_mscale=1\.0"),
    ],
)
def test_what_the_two_yarns_compute_differently_is_refused_naming_the_key(family, overrides, message):
    with pytest.raises(ModelConfigError, match=message):
        tiny_family_config(family, **{**YARN_TEST_OVERRIDES, **overrides}).validate()


def test_the_test_yarn_mixes_kept_and_interpolated_frequencies():
    """The tiny YaRN must make the equivalence tests see all three regimes of the ramp: megatron's correction
    range for a head of 8 RoPE dims (4 frequencies; MLA's 4 dims: 2) with base 10^4, 16 original positions,
    betas 8 / 0.25 is dims (0, 2): frequency 0 kept, 1 half-interpolated, 2 and 3 interpolated by 4."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_find_correction_range,
        _yarn_linear_ramp_mask,
    )

    low, high = _yarn_find_correction_range(8.0, 0.25, 8, 10000.0, 16)
    assert (low, high) == (0, 2)
    assert _yarn_linear_ramp_mask(low, high, 4, device="cpu").tolist() == [0.0, 0.5, 1.0, 1.0]
    assert _yarn_find_correction_range(8.0, 0.25, 4, 10000.0, 16) == (0, 1)  # MLA: frequency 0 kept, 1 not
