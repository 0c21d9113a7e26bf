"""The embedded engine's lean Qwen3-MoE forward against transformers' own forward on the same weights: a
left-padded prefill, decode steps over the KV cache, rows leaving the batch; logits to float tolerance and the
routers' top-k equal. Which models it serves, and its in-place KV cache against transformers' concatenating one."""

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.config import EmbeddedConfig
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.embedded.kv_cache import keep_cache_rows
from gspo_megatron.rollout.embedded.lean_forward import (
    GrowingKVLayer,
    LeanForwardRefusal,
    Qwen3MoeLeanForward,
    grouped_experts,
    growing_cache,
    lean_forward_for,
)

VOCAB = 96


def qwen3_moe(**overrides) -> Qwen3MoeForCausalLM:
    """A tiny Qwen3-MoE with large random weights (peaked routers and logits), layer 1 dense."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        max_position_embeddings=128,
    )
    values.update(overrides)
    config = Qwen3MoeConfig(**values)
    config._attn_implementation = "sdpa"
    torch.manual_seed(4)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.uniform_(0.5, 1.5) if name.endswith("norm.weight") else parameter.normal_(0.0, 0.35)
    return model


def transformers_step(model, ids, mask, positions, cache):
    """transformers' forward as the engine called it: last logits and each MoE layer's router top-k (what its
    router returns, by a hook as the engine's ``RouterCapture`` takes it)."""
    routed, handles = {}, []
    for index, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            record = lambda module, inputs, output, index=index: routed.__setitem__(index, output[2])
            handles.append(layer.mlp.gate.register_forward_hook(record))
    try:
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
            logits_to_keep=1,
        ).logits  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    return logits, routed


def assert_same_step(model, lean, ids, mask, positions, theirs_cache, our_cache):
    logits, routed = transformers_step(model, ids, mask, positions, theirs_cache)
    ours = lean(ids, mask, positions, our_cache)
    torch.testing.assert_close(ours.logits, logits, atol=2e-5, rtol=2e-5)
    assert ours.routed.keys() == routed.keys() and len(routed) == 2
    real = mask[:, -ids.shape[1] :].bool().reshape(-1)  # padding positions route whatever: never used
    for layer, indices in routed.items():
        assert torch.equal(ours.routed[layer][real].sort(-1).values, indices[real].sort(-1).values)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_prefill_and_decode_match_transformers_forward(norm_topk_prob):
    model = qwen3_moe(norm_topk_prob=norm_topk_prob)
    lean = lean_forward_for(model)
    assert isinstance(lean, Qwen3MoeLeanForward)
    generator = torch.Generator().manual_seed(0)
    lengths = [7, 3, 5, 1]
    ids = torch.randint(0, VOCAB, (4, 7), generator=generator)
    mask = torch.stack([torch.arange(7) >= 7 - n for n in lengths]).long()  # left padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    theirs, ours = DynamicCache(config=model.config), growing_cache(model.config)
    with torch.no_grad():
        assert_same_step(model, lean, ids, mask, positions, theirs, ours)
        for step in range(80):  # past the cache's first room: it grows once at least
            if step == 40:  # rows 1 and 3 leave the batch, as finished rows do
                keep = torch.tensor([2, 0])
                keep_cache_rows(theirs, keep), keep_cache_rows(ours, keep)
                mask, positions = mask[keep], positions[keep]
            ids = torch.randint(0, VOCAB, (mask.shape[0], 1), generator=generator)
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(ids)], -1)
            assert_same_step(model, lean, ids, mask, positions, theirs, ours)


def test_without_a_cache_every_step_feeds_the_whole_sequence():
    model, generator = qwen3_moe(), torch.Generator().manual_seed(1)
    lean = lean_forward_for(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        assert_same_step(model, lean, ids, mask, positions, None, None)


def test_grouped_experts_equal_transformers_experts():
    """The expert block alone, with experts that get no rows, and widths the grouped kernel cannot take (rows not a
    multiple of 16 bytes: the per-expert loop)."""
    for intermediate in (16, 6):
        model = qwen3_moe(moe_intermediate_size=intermediate)
        model.config._experts_implementation = "eager"  # transformers' loop over experts (its grouped_mm refuses 6)
        experts = model.model.layers[0].mlp.experts
        generator = torch.Generator().manual_seed(intermediate)
        rows = torch.randn(5, 32, generator=generator)
        top_index = torch.tensor([[0, 1], [1, 0], [4, 1], [0, 4], [1, 4]])  # experts 2, 3, 5 get nothing
        top_weight = torch.rand(5, 2, generator=generator)
        with torch.no_grad():
            torch.testing.assert_close(
                grouped_experts(experts, rows, top_index, top_weight),
                experts(rows, top_index, top_weight),
                atol=1e-5,
                rtol=1e-5,
            )


def test_growing_layer_holds_what_a_dynamic_layer_holds():
    grown, plain, generator = GrowingKVLayer(), DynamicLayer(), torch.Generator().manual_seed(2)
    for length in (5, 1, 70, 1):  # the third update outgrows the first room
        keys, values = torch.randn(2, 3, 2, length, 4, generator=generator)
        for got, expected in zip(grown.update(keys, values), plain.update(keys, values), strict=True):
            assert torch.equal(got, expected)
    keep = torch.tensor([1])
    grown.batch_select_indices(keep), plain.batch_select_indices(keep)
    assert torch.equal(grown.keys, plain.keys) and torch.equal(grown.values, plain.values)
    assert grown.get_seq_length() == plain.get_seq_length() == 77


def test_a_layer_given_its_capacity_reserves_one_room_of_exactly_that_size():
    """The engine gives each generation's cache its prompt width + longest budget: one room, no doubling (the
    planner's KV model; before, the room doubled: 2x the KV, 3x while it grew), and past it the room grows."""
    grown, plain, generator = GrowingKVLayer(capacity=9), DynamicLayer(), torch.Generator().manual_seed(3)
    for length in (6, 1, 1, 1):  # a 6-token prompt and 3 decode steps: 9 positions
        keys, values = torch.randn(2, 2, 3, length, 4, generator=generator)
        for got, expected in zip(grown.update(keys, values), plain.update(keys, values), strict=True):
            assert torch.equal(got, expected)
        assert grown._key_room is not None and grown._key_room.shape[-2] == 9
    keys, values = torch.randn(2, 2, 3, 1, 4, generator=generator)  # a later turn outgrows it
    for got, expected in zip(grown.update(keys, values), plain.update(keys, values), strict=True):
        assert torch.equal(got, expected)
    assert grown._key_room.shape[-2] > 10


def test_other_models_keep_transformers_forward():
    assert isinstance(lean_forward_for(qwen3_moe(sliding_window=4, use_sliding_window=True)), LeanForwardRefusal)
    eager = qwen3_moe()
    eager.config._attn_implementation = "eager"
    assert "attn_implementation" in lean_forward_for(eager).reason
    mixtral = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    engine = EmbeddedEngine(mixtral, EmbeddedConfig())
    assert engine._lean is None  # the family's transformers forward (its own expert loop) runs


def test_engine_samples_alike_with_either_forward():
    """The engine's tokens, log-probs (to float tolerance) and routed experts with the lean forward and with
    transformers' (``rollout.embedded.forward``), rows finishing at different steps."""
    source = qwen3_moe()
    engines = {}
    for forward in ("lean", "transformers"):
        engine = EmbeddedEngine(source.config, EmbeddedConfig(forward=forward))
        engine.update_weights(source.state_dict().items(), version=1)
        engines[forward] = engine
    assert engines["lean"]._lean is not None and engines["transformers"]._lean is None
    params = SamplingParams(
        temperature=1.0,
        max_new_tokens=12,
        n=3,
        seed=7,
        stop_token_ids=tuple(range(0, VOCAB, 6)),
        return_routed_experts=True,
    )
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
    lean, theirs = (engines[name].generate(prompts, params) for name in ("lean", "transformers"))
    lengths = {len(sample.output_ids) for group in lean for sample in group}
    assert len(lengths) > 1  # rows left the batch at different steps
    for group_lean, group_theirs in zip(lean, theirs, strict=True):
        for ours, expected in zip(group_lean, group_theirs, strict=True):
            assert ours.output_ids == expected.output_ids
            torch.testing.assert_close(ours.output_log_probs, expected.output_log_probs, atol=1e-5, rtol=1e-5)
            assert torch.equal(ours.routed_experts.sort(-1).values, expected.routed_experts.sort(-1).values)


def test_expert_weights_are_stored_transposed_with_their_values_and_parameters():
    """The lean forward lays each expert weight [E, out, in] out as [E, in, out] (``store_transposed``): the same
    Parameter objects and values, the grouped GEMMs' operand contiguous, and per-expert checkpoint tensors still
    land in their expert's rows."""
    model = qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    before = {name: (parameter, parameter.detach().clone()) for name, parameter in experts.named_parameters()}
    Qwen3MoeLeanForward(model)
    for name, (parameter, values) in before.items():
        now = dict(experts.named_parameters())[name]
        assert now is parameter and torch.equal(now, values)
        assert not now.is_contiguous() and now.transpose(1, 2).is_contiguous()
    engine = EmbeddedEngine(model.config, EmbeddedConfig())
    engine.update_weights(model.state_dict().items(), version=1)
    gate = torch.randn(experts.intermediate_dim, model.config.hidden_size)
    engine.update_weights([("model.layers.0.mlp.experts.2.gate_proj.weight", gate)], version=2)
    loaded = engine.model.model.layers[0].mlp.experts.gate_up_proj
    assert loaded.transpose(1, 2).is_contiguous()
    assert torch.equal(loaded[2, : experts.intermediate_dim], gate)
    assert torch.equal(loaded[1], experts.gate_up_proj[1])
