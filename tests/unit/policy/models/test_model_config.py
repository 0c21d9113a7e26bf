"""MoEModelConfig: every validation rule, hand-computed parameter counts, and HF config interop
(``from_hf_dict`` / ``from_hf_config_file`` / ``to_hf_dict``) including each malformed input."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from gspo_megatron.policy.models.config import PRESETS, ModelConfigError, MoEModelConfig, preset

# Qwen3-30B-A3B's published config.json (Hugging Face, Qwen/Qwen3-30B-A3B), verbatim fields.
QWEN3_30B_A3B_CONFIG_JSON = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def refused(build, *fragments: str) -> str:
    """``build()`` (a config is validated as it is built) raises naming every fragment."""
    with pytest.raises(ModelConfigError) as info:
        build()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    return str(info.value)


# --- validation rules --------------------------------------------------------------------------
def test_defaults_and_presets_are_valid():
    MoEModelConfig().validate()
    for name in PRESETS:
        preset(name).validate()


@pytest.mark.parametrize(
    "name", ["vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim"]
)
def test_sizes_must_be_positive(name):
    refused(lambda: MoEModelConfig(**{name: 0}), f"model.{name}", ">= 1", "got 0")


def test_query_heads_must_be_a_multiple_of_kv_heads():
    refused(
        lambda: MoEModelConfig(num_attention_heads=6, num_kv_heads=4), "num_attention_heads = 6", "num_kv_heads = 4"
    )


def test_dense_layers_must_be_inside_the_model():
    refused(lambda: MoEModelConfig(num_layers=2, dense_layers=[0, 2, -1], dense_intermediate_size=8), "[2, -1]", "0..1")


def test_dense_layers_need_a_dense_ffn_size():
    refused(lambda: MoEModelConfig(dense_layers=[0]), "dense_layers", "dense_intermediate_size is 0")


@pytest.mark.parametrize("top_k", [0, 5])
def test_top_k_within_expert_count(top_k):
    refused(lambda: MoEModelConfig(num_experts=4, top_k=top_k), f"top_k = {top_k}", "num_experts = 4")


def test_moe_needs_an_expert_ffn_size():
    refused(lambda: MoEModelConfig(moe_intermediate_size=0), "moe_intermediate_size")


def test_moe_rules_skipped_when_every_layer_is_dense():
    dense = MoEModelConfig(
        num_layers=2, dense_layers=[0, 1], dense_intermediate_size=8, top_k=99, moe_intermediate_size=0
    )
    assert not dense.is_moe
    dense.validate()


def test_is_moe():
    assert MoEModelConfig().is_moe
    assert not MoEModelConfig(num_experts=0).is_moe
    assert MoEModelConfig(num_layers=3, dense_layers=[0, 2], dense_intermediate_size=8).is_moe


# --- parameter counts ------------------------------------------------------------------------
def test_parameter_count_by_hand():
    # defaults: V=256 h=64 L=2 heads 4/2 kv, head_dim 16, E=4, k=2, moe ffn 32, untied
    attn = 64 * 16 * (2 * 4 + 2 * 2) + 2 * 16  # q,o: h x 4*16; k,v: h x 2*16; q/k norms
    norms = 2 * 64
    expert = 3 * 64 * 32
    router = 4 * 64
    embed = 2 * 256 * 64 + 64  # embedding + output layer + final norm
    counts = MoEModelConfig().parameter_count()
    assert counts["total"] == embed + 2 * (attn + norms + 4 * expert + router) == 107392
    assert counts["active"] == embed + 2 * (attn + norms + 2 * expert + router) == 82816
    tied = MoEModelConfig(tie_word_embeddings=True).parameter_count()
    assert counts["total"] - tied["total"] == 256 * 64


def test_shared_expert_and_qkv_biases_count_in_total_and_active():
    base = MoEModelConfig().parameter_count()  # Qwen3-MoE: q/k norms, no biases, no shared expert
    qwen2 = MoEModelConfig(
        family="qwen2_moe", qk_norm=False, qkv_bias=True, shared_expert_intermediate_size=48
    ).parameter_count()
    shared = 3 * 64 * 48 + 64  # three projections + the sigmoid gate
    biases = (4 + 2 + 2) * 16  # q, k, v: heads x head_dim each
    norms = 2 * 16  # Qwen3-MoE's q and k norms, which Qwen2-MoE lacks
    assert qwen2["total"] - base["total"] == 2 * (shared + biases - norms)
    assert qwen2["active"] - base["active"] == 2 * (shared + biases - norms)


@pytest.mark.parametrize(
    "cfg",
    [
        MoEModelConfig(),
        MoEModelConfig(tie_word_embeddings=True),
        MoEModelConfig(
            vocab_size=64,
            hidden_size=32,
            num_layers=3,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=8,
            num_experts=4,
            top_k=2,
            moe_intermediate_size=16,
            dense_layers=[1],
            dense_intermediate_size=24,
        ),
    ],
    ids=["default", "tied", "dense_layer"],
)
def test_parameter_count_equals_transformers_model(cfg):
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(cfg.to_hf_config())
    assert sum(p.numel() for p in hf.parameters()) == cfg.parameter_count()["total"]


def test_qwen3_30b_a3b_counts():
    counts = preset("qwen3_30b_a3b").parameter_count()
    assert counts["total"] == 30_532_122_624  # the "30B"
    assert 3.3e9 < counts["active"] < 3.4e9  # the "A3B"


# --- HF config interop -------------------------------------------------------------------------
def test_real_qwen3_30b_config_json_matches_the_preset():
    cfg = MoEModelConfig.from_hf_dict(QWEN3_30B_A3B_CONFIG_JSON)
    assert asdict(cfg) == asdict(preset("qwen3_30b_a3b"))


def test_hf_round_trip_with_dense_layers():
    cfg = MoEModelConfig(
        num_layers=4,
        dense_layers=[0, 3],
        dense_intermediate_size=96,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        router_aux_loss_coef=0.01,
        norm_topk_prob=False,
    )
    assert asdict(MoEModelConfig.from_hf_dict(cfg.to_hf_dict())) == asdict(cfg)


def test_to_hf_config_builds_transformers_config():
    hf = MoEModelConfig(num_layers=3, dense_layers=[1], dense_intermediate_size=40).to_hf_config()
    assert (hf.num_hidden_layers, hf.mlp_only_layers, hf.intermediate_size) == (3, [1], 40)


def test_shared_expert_cannot_be_exported():
    with pytest.raises(ModelConfigError, match="no shared expert"):
        MoEModelConfig(shared_expert_intermediate_size=16).to_hf_dict()


def test_decoder_sparse_step_and_mlp_only_layers_make_dense_layers():
    base = dict(
        model_type="qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=48,
    )
    # HF: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    cfg = MoEModelConfig.from_hf_dict({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.dense_layers == [0, 2, 3, 4]
    assert cfg.dense_intermediate_size == 48
    all_moe = MoEModelConfig.from_hf_dict(base)
    assert all_moe.dense_layers == [] and all_moe.dense_intermediate_size == 0


def test_optional_fields_fall_back_like_transformers():
    cfg = MoEModelConfig.from_hf_dict(
        dict(
            model_type="qwen3_moe",
            vocab_size=64,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},  # transformers 5 layout
        )
    )
    assert cfg.num_kv_heads == 6  # no GQA field: multi-head attention
    assert cfg.head_dim == 8  # hidden_size / heads
    assert cfg.rope_theta == 5000.0


def test_wrong_model_type_is_named():
    with pytest.raises(ModelConfigError, match=r"model_type='llama'.*qwen3_moe"):
        MoEModelConfig.from_hf_dict({**QWEN3_30B_A3B_CONFIG_JSON, "model_type": "llama"})
    with pytest.raises(ModelConfigError, match="model_type=None"):
        MoEModelConfig.from_hf_dict({k: v for k, v in QWEN3_30B_A3B_CONFIG_JSON.items() if k != "model_type"})


def test_missing_required_fields_are_listed():
    broken = {k: v for k, v in QWEN3_30B_A3B_CONFIG_JSON.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(ModelConfigError) as info:
        MoEModelConfig.from_hf_dict(broken)
    assert "vocab_size" in str(info.value) and "hidden_size" in str(info.value)


def test_inconsistent_hf_config_fails_validation_with_numbers():
    with pytest.raises(ModelConfigError, match=r"num_attention_heads = 32.*num_kv_heads = 5"):
        MoEModelConfig.from_hf_dict({**QWEN3_30B_A3B_CONFIG_JSON, "num_key_value_heads": 5})
    with pytest.raises(ModelConfigError, match=r"top_k = 200.*num_experts = 128"):
        MoEModelConfig.from_hf_dict({**QWEN3_30B_A3B_CONFIG_JSON, "num_experts_per_tok": 200})


def test_from_hf_config_file_accepts_file_or_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG_JSON))
    by_dir = MoEModelConfig.from_hf_config_file(tmp_path)
    by_file = MoEModelConfig.from_hf_config_file(str(tmp_path / "config.json"))
    assert asdict(by_dir) == asdict(by_file) == asdict(preset("qwen3_30b_a3b"))


def test_from_hf_config_file_missing(tmp_path):
    with pytest.raises(ModelConfigError, match=r"no Hugging Face config at .*config\.json"):
        MoEModelConfig.from_hf_config_file(tmp_path)  # a directory without config.json
    with pytest.raises(ModelConfigError, match="no Hugging Face config at"):
        MoEModelConfig.from_hf_config_file(tmp_path / "nope.json")


def test_from_hf_config_file_invalid_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen3_moe",')
    with pytest.raises(ModelConfigError, match=r"config\.json is not valid JSON"):
        MoEModelConfig.from_hf_config_file(path)


# --- presets ----------------------------------------------------------------------------------
def test_unknown_preset_lists_valid_names():
    with pytest.raises(ModelConfigError, match=r"'huge'.*qwen3_30b_a3b.*tiny"):
        preset("huge")


def test_preset_returns_an_independent_copy():
    cfg = preset("tiny")
    cfg.dense_layers.append(0)
    cfg.hidden_size = 1
    assert PRESETS["tiny"].dense_layers == [] and PRESETS["tiny"].hidden_size == 64
