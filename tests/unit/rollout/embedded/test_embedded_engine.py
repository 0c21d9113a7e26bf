"""EmbeddedEngine: KV cache vs none, log-probs vs a full forward, seeds, stop rules, routed experts,
weight loading from a save_pretrained checkpoint."""

import warnings

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from gspo_megatron.contracts.samples import FinishReason, SamplingParams
from gspo_megatron.rollout.config import EmbeddedConfig
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine

VOCAB = 96
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + "!@#$%^&*()-_=+[]{};:,.<>/?|~`'\" "


def decode(ids):  # a character-level "tokenizer": token i is one character
    return "".join(ALPHABET[i] for i in ids)


def tiny_config(**overrides):
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    values.update(overrides)
    return Qwen3MoeConfig(**values)


def peaked_source_model(hf_config, seed=1):
    """A random model with large weights, so its next-token distributions are far from uniform."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.35)
    return model


def engine_from(source, **config):
    engine = EmbeddedEngine(
        tiny_config(**{k: v for k, v in source.config.to_dict().items() if k in ("mlp_only_layers",)}),
        EmbeddedConfig(**config),
        decode,
    )
    engine.update_weights(source.state_dict().items(), version=1)
    return engine


@pytest.fixture(scope="module")
def source():
    return peaked_source_model(tiny_config())


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def full_forward_log_probs(model, prompt, output, temperature):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    scaled = torch.log_softmax(logits / temperature, -1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return scaled[positions, torch.tensor(output)]


def test_kv_cache_matches_no_cache(source):
    cached, uncached = engine_from(source, use_cache=True), engine_from(source, use_cache=False)
    for params in (
        SamplingParams(temperature=0, max_new_tokens=10),
        SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=5),
    ):
        a, b = cached.generate(PROMPTS, params), uncached.generate(PROMPTS, params)
        for group_a, group_b in zip(a, b, strict=True):
            for x, y in zip(group_a, group_b, strict=True):
                assert x.output_ids == y.output_ids
                torch.testing.assert_close(x.output_log_probs, y.output_log_probs, atol=1e-5, rtol=1e-5)


def test_generation_passes_no_deprecated_argument(source):
    """transformers 5.x deprecates ``past_key_values`` (removed in 5.40): the engine must not pass it."""
    engine = engine_from(source, use_cache=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=3))
    deprecations = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not deprecations, [str(w.message) for w in deprecations]


def test_greedy_output_is_argmax_and_not_degenerate(source):
    engine = engine_from(source)
    outputs = [
        group[0].output_ids for group in engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    ]
    assert len({tuple(o) for o in outputs}) == len(PROMPTS)  # prompts lead to different continuations
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = source(input_ids=ids).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == output


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 5, 0.9)])
def test_log_probs_equal_full_forward(source, temperature, top_k, top_p):
    engine = engine_from(source)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=9, n=2, seed=3)
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
        for sample in group:
            expected = full_forward_log_probs(source, prompt, sample.output_ids, temperature or 1.0)
            torch.testing.assert_close(sample.output_log_probs, expected, atol=1e-5, rtol=1e-5)
            assert sample.weight_version == 1


def test_top_k_restricts_sampled_tokens(source):
    engine = engine_from(source)
    params = SamplingParams(temperature=1.5, top_k=2, max_new_tokens=6, n=4, seed=0)
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
        for sample in group:
            ids = torch.tensor([prompt + sample.output_ids])
            with torch.no_grad():
                logits = source(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            top2 = logits.topk(2, dim=-1).indices.tolist()
            assert all(token in allowed for token, allowed in zip(sample.output_ids, top2, strict=True))


def test_seed_determinism_and_batch_independence(source):
    small_batches = engine_from(source, max_batch_size=1)
    big_batches = engine_from(source, max_batch_size=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=42)
    first = big_batches.generate(PROMPTS, params)
    again = big_batches.generate(PROMPTS, params)
    chunked = small_batches.generate(PROMPTS, params)
    other_seed = big_batches.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=43))
    ids = lambda result: [[s.output_ids for s in group] for group in result]
    assert ids(first) == ids(again) == ids(chunked)
    assert ids(first) != ids(other_seed)
    assert len({tuple(s.output_ids) for s in first[0]}) > 1  # the n samples of one prompt differ


@pytest.mark.parametrize("use_cache", [True, False])
def test_finished_rows_leave_the_batch(use_cache):
    """Rows that stop early leave the model's batch (and the KV cache); what every row gets is what
    it gets decoded alone: the same tokens and routed experts, log-probs of a full forward."""
    source = peaked_source_model(tiny_config(mlp_only_layers=[1]), seed=2)
    batched, alone = engine_from(source, use_cache=use_cache), engine_from(source, max_batch_size=1)
    fed_rows = []
    # the token embedding sees every forward's ids, transformers' forward and the lean one alike
    batched.model.model.embed_tokens.register_forward_pre_hook(lambda module, args: fed_rows.append(args[0].shape[0]))
    params = SamplingParams(
        temperature=1.0,
        max_new_tokens=6,
        n=4,
        seed=3,
        stop_token_ids=tuple(range(0, VOCAB, 6)),
        return_routed_experts=True,
    )
    result = batched.generate(PROMPTS, params)
    samples = [sample for group in result for sample in group]
    lengths = sorted(len(s.output_ids) for s in samples)
    assert lengths[0] < lengths[-1] and {s.finish_reason for s in samples} == {FinishReason.STOP, FinishReason.LENGTH}
    # with a cache the prefill feeds each prompt once (``_prefill_once_per_prompt``), the next forward all 12
    # rows, without one every forward feeds every row still running; after each step the finished rows are gone
    prefill, decode = (fed_rows[0], fed_rows[1:]) if use_cache else (None, fed_rows)
    assert prefill in ((len(PROMPTS),) if use_cache else (None,))
    assert decode[0] <= len(samples) and decode == sorted(decode, reverse=True)
    assert (decode[0] == len(samples)) == (lengths[0] > 1 or not use_cache)
    assert fed_rows[-1] == sum(1 for n in lengths if n == lengths[-1])
    assert len(fed_rows) == lengths[-1]
    for prompt, group, group_alone in zip(PROMPTS, result, alone.generate(PROMPTS, params), strict=True):
        for sample, single in zip(group, group_alone, strict=True):
            assert sample.output_ids == single.output_ids and sample.finish_reason == single.finish_reason
            assert torch.equal(sample.routed_experts, single.routed_experts)
            expected = full_forward_log_probs(source, prompt, sample.output_ids, 1.0)
            torch.testing.assert_close(sample.output_log_probs, expected, atol=1e-5, rtol=1e-5)


def test_stop_token_stop_string_and_length(source):
    engine = engine_from(source)
    greedy = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10))[0][0]
    assert greedy.finish_reason == FinishReason.LENGTH and len(greedy.output_ids) == 10
    stop_id = greedy.output_ids[3]
    first = greedy.output_ids.index(stop_id)
    by_id = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop_id,)))[
        0
    ][0]
    assert by_id.output_ids == greedy.output_ids[: first + 1] and by_id.finish_reason == FinishReason.STOP
    stop_text = decode(greedy.output_ids[4:6])
    cut = next(i for i in range(1, 11) if stop_text in decode(greedy.output_ids[:i]))
    by_text = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10, stop=(stop_text,)))[0][0]
    assert by_text.output_ids == greedy.output_ids[:cut] and by_text.finish_reason == FinishReason.STOP
    torch.testing.assert_close(by_text.output_log_probs, greedy.output_log_probs[:cut])


def test_stop_strings_need_decode(source):
    engine = EmbeddedEngine(tiny_config(), EmbeddedConfig())
    with pytest.raises(ValueError, match="decode"):
        engine.generate([[1, 2]], SamplingParams(stop=("x",)))


@pytest.mark.parametrize("use_cache", [True, False])
def test_routed_experts_equal_full_forward_router_top_k(use_cache):
    source = peaked_source_model(tiny_config(mlp_only_layers=[1]), seed=2)
    engine = engine_from(source, use_cache=use_cache)
    params = SamplingParams(temperature=1.0, max_new_tokens=7, n=2, seed=9, return_routed_experts=True)
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
        for sample in group:
            fed = prompt + sample.output_ids[:-1]
            assert sample.routed_experts.shape == (len(fed), 2, 2) and sample.routed_experts.dtype == torch.int32
            with torch.no_grad():
                router_logits = source(input_ids=torch.tensor([fed]), output_router_logits=True).router_logits
            assert len(router_logits) == 1  # layer 1 is dense
            expected = torch.softmax(router_logits[0].float(), -1).topk(2, dim=-1).indices
            assert torch.equal(sample.routed_experts[:, 0].long(), expected)
            assert (sample.routed_experts[:, 1] == -1).all()  # dense layer: no experts


def assert_loaded_like(engine: EmbeddedEngine, source, ids: torch.Tensor) -> None:
    """The engine holds every parameter of ``source`` bit for bit, and its model gives ``source``'s logits to float
    tolerance: the lean forward keeps the expert weights transposed in memory (``lean_forward.py:
    store_transposed``), where the GEMMs sum in another order."""
    loaded = engine.model.state_dict()
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids=ids).logits, source(input_ids=ids).logits)


def test_update_weights_from_save_pretrained_reproduces_logits(source, tmp_path):
    source.save_pretrained(tmp_path)
    engine = EmbeddedEngine(tiny_config(), EmbeddedConfig())
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        expected = source(input_ids=ids).logits
        assert not torch.allclose(engine.model(input_ids=ids).logits, expected)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        names = list(handle.keys())
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names  # per-expert names, as on disk
        engine.update_weights(((name, handle.get_tensor(name)) for name in names), version=7)
    assert_loaded_like(engine, source, ids)
    assert engine.weight_version == 7


def test_update_weights_subset_touches_only_its_slice(source):
    engine = engine_from(source)
    experts = engine.model.model.layers[0].mlp.experts
    before_gate_up, before_down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    new_up = torch.full((16, 32), 0.25)
    engine.update_weights([("model.layers.0.mlp.experts.2.up_proj.weight", new_up)], version=2)
    after = experts.gate_up_proj.detach()
    assert torch.equal(after[2, 16:], new_up)  # rows [I, 2I) of expert 2 are its up_proj
    changed = after != before_gate_up
    changed[2, 16:] = False
    assert not changed.any() and torch.equal(experts.down_proj, before_down)
    assert engine.weight_version == 2


def test_a_second_sync_reuses_each_names_target_and_lands_its_values(source):
    """A weight name is resolved once (every sync streams the same names): the second sync's tensors
    land in the same slices, and its names are not resolved again."""
    engine = engine_from(source)  # the first sync: every name of the model
    loader = engine._loader
    resolved = dict(loader._resolved)
    assert len(resolved) == len(source.state_dict())
    doubled = [(name, 2 * tensor) for name, tensor in source.state_dict().items()]
    engine.update_weights(doubled, version=2)
    assert loader._resolved.keys() == resolved.keys()  # no name resolved again, no target replaced
    assert all(loader._resolved[name] is target for name, target in resolved.items())
    for name, tensor in doubled:
        target = loader.resolve(name)
        assert torch.equal(target.parameter.data[target.index] if target.index else target.parameter.data, tensor)


@pytest.mark.parametrize(
    "name,shape,error,match",
    [
        ("model.layers.0.self_attn.q_prj.weight", (32, 32), KeyError, "closest valid names"),
        ("model.layers.0.mlp.experts.4.gate_proj.weight", (16, 32), KeyError, "expert 4 does not exist"),
        ("model.layers.5.mlp.experts.0.gate_proj.weight", (16, 32), KeyError, "no routed experts"),
        ("model.layers.0.mlp.experts.1.down_proj.weight", (16, 32), ValueError, r"expects \(32, 16\)"),
        ("model.norm.weight", (31,), ValueError, "expects"),
    ],
)
def test_update_weights_rejects_bad_names_and_shapes(source, name, shape, error, match):
    engine = engine_from(source)
    with pytest.raises(error, match=match):
        engine.update_weights([(name, torch.zeros(shape))], version=9)
    assert engine.weight_version == 1


def test_tied_embeddings_round_trip_and_config_file(tmp_path):
    """A tied checkpoint omits lm_head.weight on disk; the engine built from its config.json (as the
    policy's shape reaches it: an HF config object) still reproduces the logits, and either name updates
    the shared matrix."""
    source = peaked_source_model(tiny_config(tie_word_embeddings=True), seed=5)
    source.tie_weights()
    source.save_pretrained(tmp_path)
    engine = EmbeddedEngine(Qwen3MoeConfig.from_pretrained(tmp_path), EmbeddedConfig())
    assert engine.model.config.tie_word_embeddings and engine.model.config.num_experts == 4
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        assert "lm_head.weight" not in handle.keys()  # noqa: SIM118 - keys() only: not a mapping, not iterable
        engine.update_weights(((n, handle.get_tensor(n)) for n in handle.keys()), version=1)  # noqa: SIM118 - keys() only: not a mapping, not iterable
    ids = torch.tensor([[5, 6, 7, 8]])
    assert_loaded_like(engine, source, ids)
    new_head = torch.randn(VOCAB, 32)
    engine.update_weights([("lm_head.weight", new_head)], version=2)
    assert torch.equal(engine.model.model.embed_tokens.weight, new_head)
