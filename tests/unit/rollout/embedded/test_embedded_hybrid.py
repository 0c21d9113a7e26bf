"""The embedded engine serves the gated-DeltaNet hybrids (Qwen3.5-MoE, Qwen3-Next): rows that finish early leave
the batch and the cache -- the linear-attention layers' conv and recurrent states with the attention layers'
keys and values (``keep_cache_rows``) -- and every row gets what it gets decoded alone, log-probs those of a
full forward of its tokens (so the left-padded prefill leaves the recurrent state as a row alone has it)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

from gspo_megatron.contracts.samples import FinishReason, SamplingParams
from gspo_megatron.core.model_families import family
from gspo_megatron.rollout.config import EmbeddedConfig
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine

VOCAB = 48
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def decode(ids):
    return "".join(chr(ord("0") + i) for i in ids)


def hybrid_config(config_class):
    return config_class(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        max_position_embeddings=128,
    )


def peaked_source_model(hf_config, seed=2):
    """Random weights far from uniform next-token distributions (the norms' zero-centred weights kept small)."""
    _, model_class = family(hf_config.model_type).transformers_classes()
    torch.manual_seed(seed)
    model = model_class(hf_config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            scale = 0.1 if "norm" in name or name.endswith(("A_log", "dt_bias")) else 0.35
            parameter.normal_(0.0, scale)
    return model


def engine_for(source, **config) -> EmbeddedEngine:
    engine = EmbeddedEngine(source.config, EmbeddedConfig(**config), decode)
    engine.update_weights(source.state_dict().items(), version=1)
    return engine


def full_forward_log_probs(model, prompt, output):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return torch.log_softmax(logits, -1)[positions, torch.tensor(output)]


@pytest.mark.parametrize("config_class", [Qwen3_5MoeTextConfig, Qwen3NextConfig], ids=["qwen3_5_moe", "qwen3_next"])
def test_a_hybrid_model_finished_rows_leave_the_batch_and_its_recurrent_state(config_class):
    source = peaked_source_model(hybrid_config(config_class))
    batched, alone = engine_for(source), engine_for(source, max_batch_size=1)
    params = SamplingParams(
        temperature=1.0,
        max_new_tokens=6,
        n=4,
        seed=3,
        stop_token_ids=tuple(range(0, VOCAB, 5)),
        return_routed_experts=True,
    )
    result = batched.generate(PROMPTS, params)
    samples = [sample for group in result for sample in group]
    lengths = sorted(len(s.output_ids) for s in samples)
    assert lengths[0] < lengths[-1] and {s.finish_reason for s in samples} == {FinishReason.STOP, FinishReason.LENGTH}
    for prompt, group, group_alone in zip(PROMPTS, result, alone.generate(PROMPTS, params), strict=True):
        for sample, single in zip(group, group_alone, strict=True):
            assert sample.output_ids == single.output_ids and sample.finish_reason == single.finish_reason
            assert torch.equal(sample.routed_experts, single.routed_experts)
            expected = full_forward_log_probs(source, prompt, sample.output_ids)
            torch.testing.assert_close(sample.output_log_probs, expected, atol=1e-5, rtol=1e-5)
