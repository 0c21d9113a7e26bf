"""What ``policy/models/weight_sources.py:SafetensorsSource`` reads from a HF checkpoint directory.

A block-FP8 checkpoint (DeepSeek-V3's and Kimi-K2's published weights, this project's ``--fp8-block`` export)
is read as the weights it stands for: each float8 projection times its ``_scale_inv`` blocks, at config.json's
block size; a float8 tensor without scales is refused by name, never cast as it stands. A tensor the model
config has no place for is refused (``check_checkpoint_names``), except multi-token-prediction layers, set
aside."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from gspo_megatron.core.fp8_blocks import (
    FP8_DTYPE,
    dequantize_block_fp8,
    fake_quantize_named_tensors,
    is_quantized,
    quantize_block_fp8,
)
from gspo_megatron.policy.models.hf_checkpoint import write_hf_checkpoint
from gspo_megatron.policy.models.weight_sources import ConversionError, SafetensorsSource, check_checkpoint_names
from gspo_megatron.testing.model_fixtures import random_hf_state, tiny_family_config


def test_an_fp8_export_reads_back_as_its_dequantized_weights(tmp_path):
    cfg = tiny_family_config("deepseek_v3")
    state = random_hf_state(cfg, seed=2)
    write_hf_checkpoint([list(state.items())], cfg, tmp_path / "fp8", fp8_block=True)
    source = SafetensorsSource(tmp_path / "fp8")
    expected = dict(fake_quantize_named_tensors(state.items()))
    quantized = [name for name, tensor in state.items() if is_quantized(name, tensor)]
    assert len(quantized) > 10 and source.stored(quantized[0]).dtype == FP8_DTYPE  # stored in e4m3
    for name in state:
        read = source.get(name)
        assert read.dtype == torch.float32
        assert torch.equal(read, expected[name]), name
    raw = source.stored(quantized[0]).float()  # what reading the e4m3 values as they stand gave
    assert not torch.allclose(raw, expected[quantized[0]], atol=1e-2)


def test_the_block_size_is_the_checkpoints(tmp_path):
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    weight[:4, :8] *= 100.0  # one block of large values: its scale differs from the others'
    q, scale = quantize_block_fp8(weight, block=(4, 8))
    save_file({"w.q_proj.weight": q, "w.q_proj.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [4, 8]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = SafetensorsSource(tmp_path).get("w.q_proj.weight")
    assert scale.shape == (2, 2)
    assert torch.equal(read, dequantize_block_fp8(q, scale, torch.float32, (4, 8)))
    assert (read - weight).abs().max() <= weight.abs().max() * 2**-4  # e4m3's relative rounding


def test_a_float8_tensor_without_scales_is_refused_by_name(tmp_path):
    save_file({"w.q_proj.weight": torch.ones(4, 4).to(FP8_DTYPE)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"w\.q_proj\.weight is stored in torch\.float8_e4m3fn without "):
        SafetensorsSource(tmp_path).get("w.q_proj.weight")


def test_a_malformed_block_size_is_refused(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [128]}}))
    with pytest.raises(ConversionError, match=r"weight_block_size=\[128\] is not two positive ints"):
        SafetensorsSource(tmp_path)


def _checkpoint_with(tmp_path, cfg, extra: dict[str, torch.Tensor]) -> SafetensorsSource:
    state = random_hf_state(cfg, seed=3) | extra
    write_hf_checkpoint([list(state.items())], cfg, tmp_path / "ckpt")
    return SafetensorsSource(tmp_path / "ckpt")


def test_multi_token_prediction_layers_are_set_aside_not_loaded(tmp_path):
    """DeepSeek-V3's published checkpoint holds its MTP module as layer 61 of 61 (``num_nextn_predict_layers``)."""
    cfg = tiny_family_config("deepseek_v3")
    mtp = {
        f"model.layers.{cfg.num_layers}.eh_proj.weight": torch.ones(4, 8),
        f"model.layers.{cfg.num_layers}.enorm.weight": torch.ones(4),
    }
    source = _checkpoint_with(tmp_path, cfg, mtp)
    assert check_checkpoint_names(source, cfg) == sorted(mtp)


def test_qwen3_next_multi_token_prediction_module_is_set_aside_not_loaded(tmp_path):
    """Qwen3-Next's (and Qwen3.5's) checkpoints hold their MTP head as a module of its own, ``mtp.*``."""
    cfg = tiny_family_config("qwen3_next")
    mtp = {"mtp.fc.weight": torch.ones(4, 8), "mtp.layers.0.input_layernorm.weight": torch.ones(4)}
    source = _checkpoint_with(tmp_path, cfg, mtp)
    assert check_checkpoint_names(source, cfg) == sorted(mtp)


def test_a_tensor_the_model_config_has_no_place_for_is_refused(tmp_path):
    """A Qwen3-MoE checkpoint with attention biases the config does not declare: loading it without them would
    train another model."""
    cfg = tiny_family_config("qwen3_moe")
    source = _checkpoint_with(tmp_path, cfg, {"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    with pytest.raises(ConversionError, match=r"1 tensors the model config does not use.*q_proj\.bias"):
        check_checkpoint_names(source, cfg)


def test_a_tied_models_saved_head_is_the_embedding(tmp_path):
    cfg = tiny_family_config("qwen3_moe", tie_word_embeddings=True)
    source = _checkpoint_with(tmp_path, cfg, {"lm_head.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size)})
    assert check_checkpoint_names(source, cfg) == []
