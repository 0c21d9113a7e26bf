"""A real SGLang server on a tiny random Qwen3-MoE checkpoint (needs CUDA and the sglang extra).

Skipped unless both are present. Checks what the test double cannot: that the real server accepts
our request body, returns log-probs and routed experts in the layout we decode, and takes a
distributed (NCCL) weight update bracketed the 0.5.x way that really changes the model: perturbed
weights change the log-probs, the original weights restore them (not only the version number).
"""

import importlib.util
import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _tiny_moe_checkpoint(path, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        torch_dtype="bfloat16",
    )
    config = Qwen3MoeConfig(**{**shape, **overrides})
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return config


@pytest.mark.timeout(900)
def test_real_server_generates_and_takes_a_weight_update(tmp_path):
    model = tmp_path / "tiny"
    hf = _tiny_moe_checkpoint(model)
    _serves_routes_and_takes_a_weight_update(tmp_path, model, hf.num_hidden_layers, hf.num_experts)


def _deepseek_v3_tiny_checkpoint(path):
    """The project's tiny DeepSeek-V3 (conf/model/deepseek_v3_tiny.yaml: MLA, YaRN, a dense first layer, sigmoid
    router with expert bias and groups, a shared expert) as the trainer's export writes it, in bf16."""
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.policy.models.hf_checkpoint import write_hf_checkpoint
    from gspo_megatron.testing.model_fixtures import random_hf_state

    cfg = to_train_config(compose(["model=deepseek_v3_tiny"])).model
    state = {name: tensor.to(torch.bfloat16) for name, tensor in random_hf_state(cfg, seed=0).items()}
    write_hf_checkpoint([list(state.items())], cfg, path)
    return cfg


@pytest.mark.timeout(900)
def test_a_deepseek_v3_server_generates_and_takes_a_weight_update(tmp_path):
    """Multi-latent attention, which SGLang's CPU server cannot run (docs/sglang.md): served on a GPU."""
    model = tmp_path / "deepseek_v3_tiny"
    cfg = _deepseek_v3_tiny_checkpoint(model)
    _serves_routes_and_takes_a_weight_update(tmp_path, model, cfg.num_layers, cfg.num_experts)


def _serves_routes_and_takes_a_weight_update(tmp_path, model, layers: int, num_experts: int) -> None:
    from safetensors.torch import load_file

    from gspo_megatron.contracts.samples import FinishReason, SamplingParams
    from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine

    config = SGLangConfig(
        mode="launch",
        model_path=str(model),
        enable_return_routed_experts=True,
        log_dir=str(tmp_path / "logs"),
        extra_args=["--skip-tokenizer-init", "--mem-fraction-static", "0.3", "--disable-cuda-graph"],
        weight_sync="distributed",
        weight_sync_backend="nccl",
        startup_timeout_s=600,
    )
    with SGLangEngine(config) as engine:
        params = SamplingParams(max_new_tokens=8, n=2, seed=1, return_routed_experts=True)
        samples = engine.generate([[1, 2, 3, 4], [5, 6]], params)
        for prompt, row in zip([[1, 2, 3, 4], [5, 6]], samples, strict=True):
            for sample in row:
                assert 1 <= len(sample.output_ids) <= 8
                assert sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                assert torch.all(sample.output_log_probs <= 0)
                assert sample.routed_experts.shape == (len(prompt) + len(sample.output_ids) - 1, layers, 2)
                assert int(sample.routed_experts.max()) < num_experts

        # The weight update must reach the kernels: perturbed weights change the greedy first token's
        # log-prob (same prompt), and the original weights bring back exactly the original output.
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
        prompt = [[1, 2, 3, 4]]
        (before,) = engine.generate(prompt, greedy)[0]
        weights = {
            name: tensor
            for file in sorted(model.glob("*.safetensors"))
            for name, tensor in load_file(str(file), device="cuda").items()
        }
        generator = torch.Generator(device="cuda").manual_seed(0)
        perturbed = {
            name: tensor
            + 0.5
            * tensor.float().std()
            * torch.randn(tensor.shape, generator=generator, device="cuda").to(tensor.dtype)
            for name, tensor in weights.items()
        }
        engine.update_weights(sorted(perturbed.items()), version=1)
        (changed,) = engine.generate(prompt, greedy)[0]
        assert changed.weight_version == 1
        first_moved = abs(float(changed.output_log_probs[0]) - float(before.output_log_probs[0]))
        assert changed.output_ids[0] != before.output_ids[0] or first_moved > 1e-3, "the update did not reach the model"
        engine.update_weights(sorted(weights.items()), version=2)
        (restored,) = engine.generate(prompt, greedy)[0]
        assert restored.weight_version == 2
        assert restored.output_ids == before.output_ids
        torch.testing.assert_close(restored.output_log_probs, before.output_log_probs, rtol=0, atol=1e-2)
    log = next((tmp_path / "logs").glob("*.log")).read_text()
    assert json.dumps(str(model))[1:-1] in log


def _fp8_checkpoint(path):
    """A tiny Qwen3-MoE with every projection a multiple of SGLang's 128 x 128 blocks, written as a block-FP8
    checkpoint (``core/fp8_blocks.py``); returns the bf16 weights it was made from."""
    from safetensors.torch import load_file, save_file

    from gspo_megatron.core.fp8_blocks import QUANTIZATION_CONFIG, quantize_named_tensors

    _tiny_moe_checkpoint(path, hidden_size=128, moe_intermediate_size=128, num_key_value_heads=4, head_dim=32)
    weights = load_file(str(path / "model.safetensors"))
    save_file(dict(quantize_named_tensors(sorted(weights.items()))), str(path / "model.safetensors"))
    hf_config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf_config, "quantization_config": QUANTIZATION_CONFIG}))
    return weights


@pytest.mark.timeout(900)
def test_an_fp8_server_takes_block_fp8_weights_from_the_trainer(tmp_path):
    """rollout.sglang.weight_quantization=fp8_block into a server serving an FP8 checkpoint, over NCCL: the
    trainer's bf16 weights go out as block FP8; perturbed weights change the outputs, the original ones bring
    back the server's own start exactly (the same FP8 tensors it loaded)."""
    from gspo_megatron.contracts.samples import SamplingParams
    from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine

    model = tmp_path / "tiny_fp8"
    weights = _fp8_checkpoint(model)
    config = SGLangConfig(
        mode="launch",
        model_path=str(model),
        log_dir=str(tmp_path / "logs"),
        extra_args=["--skip-tokenizer-init", "--mem-fraction-static", "0.3", "--disable-cuda-graph"],
        weight_sync="distributed",
        weight_sync_backend="nccl",
        weight_quantization="fp8_block",
        startup_timeout_s=600,
    )
    config.validate()
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    prompt = [[1, 2, 3, 4]]
    with SGLangEngine(config) as engine:
        (before,) = engine.generate(prompt, greedy)[0]
        generator = torch.Generator().manual_seed(0)
        perturbed = {
            name: tensor + 0.5 * tensor.float().std() * torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
            for name, tensor in weights.items()
        }
        engine.update_weights(sorted(perturbed.items()), version=1)
        (changed,) = engine.generate(prompt, greedy)[0]
        first_moved = abs(float(changed.output_log_probs[0]) - float(before.output_log_probs[0]))
        assert changed.output_ids[0] != before.output_ids[0] or first_moved > 1e-3, "the update did not reach the model"
        engine.update_weights(sorted(weights.items()), version=2)
        (restored,) = engine.generate(prompt, greedy)[0]
        assert restored.weight_version == 2 and restored.output_ids == before.output_ids
        torch.testing.assert_close(restored.output_log_probs, before.output_log_probs, rtol=0, atol=1e-2)
