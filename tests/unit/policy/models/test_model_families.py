"""Model families as data (``core/model_families.py``): each family's config.json keys, checkpoint names and
transformers classes agree with transformers' own; what a family's HF architecture cannot represent is
refused naming the key. The forward and layouts: ``tests/distributed/test_engine_matches_megatron.py``
and ``test_model_layouts.py``; the checkpoint written and read back by transformers:
``test_hf_checkpoint.py``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from gspo_megatron.core.model_families import ALIASES, FAMILIES, PROJECTIONS, family
from gspo_megatron.policy.models.config import ModelConfigError, MoEModelConfig
from gspo_megatron.policy.models.hf_shapes import hf_shapes
from gspo_megatron.testing.model_fixtures import tiny_family_config, tiny_test_config

SHIPPED = Path(__file__).resolve().parents[4] / "tools" / "planning" / "hf_configs"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_checkpoint_names_and_shapes_are_what_transformers_saves(tmp_path, model_type):
    from safetensors import safe_open

    cfg = tiny_family_config(model_type)
    _, model_class = cfg.architecture.transformers_classes()
    model_class(cfg.to_hf_config()).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        saved = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
    assert saved == hf_shapes(cfg)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_config_json_round_trips_through_transformers(model_type):
    cfg = tiny_family_config(model_type, tie_word_embeddings=True, router_aux_loss_coef=0.01)
    written = cfg.to_hf_config().to_dict()  # transformers' own config class, its own keys back
    assert written["model_type"] == model_type
    assert asdict(MoEModelConfig.from_hf_dict(written)) == asdict(cfg)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_parameter_count_equals_transformers_model(model_type):
    cfg = tiny_family_config(model_type)
    _, model_class = cfg.architecture.transformers_classes()
    with torch.device("meta"):
        model = model_class(cfg.to_hf_config())
    assert sum(p.numel() for p in model.parameters()) == cfg.parameter_count()["total"]


def test_mixtral_expert_names_follow_w1_gate_w3_up_w2_down():
    mixtral = family("mixtral")
    names = [mixtral.expert_name(5, 7, p) for p in PROJECTIONS]
    assert names == [f"model.layers.5.block_sparse_moe.experts.7.{w}.weight" for w in ("w1", "w3", "w2")]
    assert mixtral.router_name(5) == "model.layers.5.block_sparse_moe.gate.weight"
    assert [mixtral.projection_of(w) for w in ("w1", "w3", "w2")] == list(PROJECTIONS)


def test_mixtral_8x22b_shape_is_141b_with_39b_active():
    cfg = MoEModelConfig.from_hf_config_file(SHIPPED / "mixtral_8x22b.json")
    counts = cfg.parameter_count()
    # Mistral AI states 141B parameters, 39B active, for Mixtral 8x22B
    assert (cfg.family, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == ("mixtral", 8, 2, 16384)
    assert round(counts["total"] / 1e9) == 141 and round(counts["active"] / 1e9) == 39


def test_qwen2_57b_a14b_shape_is_57b_with_14b_active():
    cfg = MoEModelConfig.from_hf_config_file(SHIPPED / "qwen2_57b_a14b.json")
    counts = cfg.parameter_count()
    assert (cfg.family, cfg.shared_expert_intermediate_size, cfg.norm_topk_prob) == ("qwen2_moe", 20480, False)
    assert round(counts["total"] / 1e9) == 57 and round(counts["active"] / 1e9) == 14  # the name's "57B-A14B"


def test_olmoe_1b_7b_shape_is_7b_with_1b_active():
    cfg = MoEModelConfig.from_hf_config_file(SHIPPED / "olmoe_1b_7b.json")
    counts = cfg.parameter_count()
    # AI2 states 6.9B parameters, 1.3B active, for OLMoE-1B-7B; its q/k norms are 2048 wide (all 16 heads)
    assert (cfg.family, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob) == ("olmoe", 64, 8, False)
    assert cfg.qk_norm_widths() == (2048, 2048) and hf_shapes(cfg)["model.layers.0.self_attn.q_norm.weight"] == (2048,)
    assert round(counts["total"] / 1e8) == 69 and round(counts["active"] / 1e8) == 13


def test_olmoe_q_norm_is_hidden_size_wide():
    with pytest.raises(ModelConfigError, match=r"model\.head_dim=4: the OLMoE architecture's q norm.*head_dim=8"):
        tiny_family_config("olmoe", head_dim=4)
    hf = tiny_family_config("olmoe").to_hf_dict() | {"clip_qkv": 8.0}
    with pytest.raises(ModelConfigError, match="clip_qkv=8.0"):
        MoEModelConfig.from_hf_dict(hf)


@pytest.mark.parametrize(
    "name, total, active_without_embeddings",
    # Z.ai states 355B / 32B active and 106B / 12B active; the multi-token-prediction layer is not built
    # here (RL trains the next token), so the total is one MoE layer short of GLM-4.5's (352.8B)
    [("glm4_5", 353, 32), ("glm4_5_air", 107, 12)],
)
def test_glm4_5_shapes(name, total, active_without_embeddings):
    cfg = MoEModelConfig.from_hf_config_file(SHIPPED / f"{name}.json")
    counts = cfg.parameter_count()
    embeddings = 2 * cfg.vocab_size * cfg.hidden_size
    assert (cfg.router_score, cfg.expert_bias, cfg.rotary_fraction, cfg.qkv_bias) == ("sigmoid", True, 0.5, True)
    assert cfg.dense_layers == list(range(3 if name == "glm4_5" else 1))
    assert cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size  # n_shared_experts = 1
    assert round(counts["total"] / 1e9) == total
    assert round((counts["active"] - embeddings) / 1e9) == active_without_embeddings


@pytest.mark.parametrize(
    "name, total, active, groups",
    # DeepSeek states 671B (without its multi-token-prediction module) and 37B active; Moonshot 1T and 32B
    [("deepseek_v3", 671, 38, 8), ("kimi_k2", 1026, 33, 1)],
)
def test_deepseek_v3_and_kimi_k2_shapes(name, total, active, groups):
    cfg = MoEModelConfig.from_hf_config_file(SHIPPED / f"{name}.json")  # kimi_k2: an alias of deepseek_v3
    counts = cfg.parameter_count()
    assert (cfg.family, cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank) == ("deepseek_v3", "mla", 1536, 512)
    assert (cfg.head_dim, cfg.v_head_dim, cfg.router_groups, cfg.top_k) == (192, 128, groups, 8)
    assert round(counts["total"] / 1e9) == total and round(counts["active"] / 1e9) == active
    # YaRN: DeepSeek-V3 stretches 4K by 40 (betas 32 / 1), Kimi-K2 by 32 (betas 1 / 1); mscale 1 / 1 both
    yarn = (cfg.rope_yarn_factor, cfg.rope_yarn_original_max_position_embeddings, cfg.rope_yarn_beta_fast)
    assert yarn == ({"deepseek_v3": 40.0, "kimi_k2": 32.0}[name], 4096, {"deepseek_v3": 32.0, "kimi_k2": 1.0}[name])
    assert (cfg.rope_yarn_beta_slow, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim) == (1.0, 1.0, 1.0)


def test_a_shipped_config_names_its_family():
    for path in SHIPPED.glob("*.json"):
        model_type = json.loads(path.read_text())["model_type"]
        assert ALIASES.get(model_type, model_type) in FAMILIES, path.name


def test_what_a_family_cannot_represent_is_refused_naming_the_key():
    with pytest.raises(ModelConfigError, match=r"model\.norm_topk_prob=False.*Mixtral.*set model\.norm_topk_prob=true"):
        tiny_family_config("mixtral", norm_topk_prob=False)
    with pytest.raises(ModelConfigError, match=r"model\.qk_norm=True.*Mixtral.*set model\.qk_norm=false"):
        tiny_family_config("mixtral", qk_norm=True)
    with pytest.raises(ModelConfigError, match=r"Mixtral architecture makes every layer MoE.*model\.dense_layers=\[\]"):
        tiny_family_config("mixtral", num_layers=3, dense_layers=[0], dense_intermediate_size=8)
    with pytest.raises(ModelConfigError, match=r"Mixtral architecture has no shared expert"):
        tiny_family_config("mixtral", shared_expert_intermediate_size=8)
    with pytest.raises(ModelConfigError, match=r"Qwen2-MoE architecture has a shared expert.*intermediate_size"):
        tiny_family_config("qwen2_moe", shared_expert_intermediate_size=0)
    with pytest.raises(ModelConfigError, match=r"model\.family='llama'.*mixtral.*qwen3_moe"):
        tiny_test_config(family="llama").validate()


def test_an_unknown_model_type_lists_the_families():
    listed = r"model_type='gpt_oss'.*Qwen3-MoE \(qwen3_moe\).*Mixtral \(mixtral\).*DeepSeek-V3.*\(deepseek_v3\)"
    with pytest.raises(ModelConfigError, match=listed):
        MoEModelConfig.from_hf_dict({"model_type": "gpt_oss"})


def test_gpt_oss_is_refused_saying_why_it_is_not_built():
    """GPT-OSS was looked at against transformers' modeling_gpt_oss.py: a checkpoint's config.json, the model.family
    key and the family lookup each say what the portable layers lack (sinks, sliding windows, clamped SwiGLU)."""
    why = r"GPT-OSS is not built: .*sink logit.*sliding-window.*clamp their SwiGLU"
    with pytest.raises(ModelConfigError, match=r"model_type='gpt_oss' \(" + why):
        MoEModelConfig.from_hf_dict({"model_type": "gpt_oss"})
    with pytest.raises(ModelConfigError, match=r"model\.family='gpt_oss' is not a model family \(" + why):
        tiny_test_config(family="gpt_oss").validate()
    with pytest.raises(KeyError, match=why):
        family("gpt_oss")


def test_a_qwen3_config_with_attention_biases_is_refused_not_loaded_without_them():
    hf = tiny_test_config().to_hf_dict() | {"attention_bias": True}
    with pytest.raises(ModelConfigError, match=r"model\.qkv_bias=True.*Qwen3-MoE.*set model\.qkv_bias=false"):
        MoEModelConfig.from_hf_dict(hf)


def test_sliding_window_attention_is_refused():
    hf = tiny_family_config("mixtral").to_hf_dict() | {"sliding_window": 4096}
    with pytest.raises(ModelConfigError, match=r"sliding_window=4096.*set it to null"):
        MoEModelConfig.from_hf_dict(hf)


def test_what_a_family_cannot_represent_is_refused_at_start_up():
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.config.validate import validate_config

    with pytest.raises(ModelConfigError, match=r"Mixtral architecture has no shared expert.*qwen2_moe"):
        validate_config(to_train_config(compose(["model=mixtral_tiny", "model.shared_expert_intermediate_size=8"])), 1)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_the_hybrid_layer_pattern_is_read_from_layer_types_and_transformers_default(model_type):
    cfg = tiny_family_config(model_type)
    hf = cfg.to_hf_dict()
    assert hf["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    without = {key: value for key, value in hf.items() if key != "layer_types"} | {"num_hidden_layers": 8}
    # transformers' default: every 4th layer full attention (full_attention_interval)
    assert MoEModelConfig.from_hf_dict(without).linear_attention_layers == [0, 1, 2, 4, 5, 6]
    with pytest.raises(ModelConfigError, match=r"layer_types=.*'sliding_attention'"):
        MoEModelConfig.from_hf_dict(hf | {"layer_types": ["linear_attention", "sliding_attention", "full_attention"]})


def test_what_the_hybrid_families_cannot_represent_is_refused_naming_the_key():
    with pytest.raises(ModelConfigError, match=r"Qwen3-MoE architecture has no linear attention.*qwen3_next"):
        tiny_test_config(linear_attention_layers=[0], linear_num_key_heads=1, linear_num_value_heads=1).validate()
    with pytest.raises(ModelConfigError, match=r"linear_num_value_heads=3 must be a multiple of.*=2"):
        tiny_family_config("qwen3_next", linear_num_value_heads=3)
    with pytest.raises(
        ModelConfigError, match=r"model\.attention_output_gate=False.*set model\.attention_output_gate=true"
    ):
        tiny_family_config("qwen3_5_moe_text", attention_output_gate=False)
    with pytest.raises(ModelConfigError, match=r"linear_attention_layers=\[0, 3\]: .* in 0\.\.2"):
        tiny_family_config("qwen3_next", linear_attention_layers=[0, 3])
