"""Qwen3-Next and Qwen3.5-MoE (hybrid stacks: gated DeltaNet linear attention + gated full attention, a
16-expert top-4 MoE with a gated shared expert) built by the trainer through megatron-core's GatedDeltaNet, on
one rank (CPU: the torch gated delta rule through ``policy/cpu_bridges.py`` bridge 12):
- every HF tensor goes in and comes back out bit-exact (HF -> megatron -> HF);
- megatron's fp32 log-probs equal transformers' own forward of the family's class on the same weights
  (rtol 1e-4, atol 1e-5), on a right-padded micro-batch (each row against transformers' forward of that row
  alone), and every MoE layer routes every real token to the same top-k experts;
- under TP=2 (sequence parallel), EP=2, TP=2 x EP=2 and PP=2 (uneven stages: 1 + 2 layers) on gloo ranks: the round trip
  is bit-exact on every rank, and the log-probs and every gradient (gathered to HF names) of a weighted
  log-likelihood through megatron's schedule equal one rank's;
- under CP=2 (megatron-core 0.19: its gated DeltaNet all-to-alls each rank's load-balanced half of the sequence
  into half the heads and back) the same; on 0.16, which has no context parallelism for it, cp is refused by
  name at start-up, as are linear-attention heads that tp * cp does not divide.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.policy.parallel.layout import LayoutError, ParallelLayout, gated_delta_net_has_context_parallel
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import (
    EQUIVALENCE_LAYOUTS,
    HYBRID_FAMILY_TEST_OVERRIDES,
    model_layout_worker,
    random_hf_state,
    tiny_family_config,
)

pytestmark = pytest.mark.distributed

LENGTHS = [12, 7]  # a right-padded micro-batch: the second row's last 5 positions are padding


def fixed_rows(cfg, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (len(LENGTHS), max(LENGTHS) + 1), generator=generator)


def megatron_worker(ctx, cfg, state: dict) -> dict:
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import export_hf_state_dict, load_hf_weights
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=5)
    try:
        model = build_model(cfg, layout, layer_spec="auto")
        load_hf_weights(model, cfg, state, mesh)
        exported = export_hf_state_dict(model, cfg, mesh)
        routed = _record_routing(model)
        rows = fixed_rows(cfg)
        tokens = rows[:, :-1].clone()
        tokens[1, LENGTHS[1] :] = 0  # padding
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        model.eval()
        with torch.no_grad():
            logits = model(tokens, positions, attention_mask=None)
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, rows[:, 1:, None]).squeeze(-1)
        layers = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
        return {"exported": exported, "log_probs": log_probs, "routed": routed, "attention": layers}
    finally:
        mesh.destroy()


def _record_routing(model) -> dict[int, list[torch.Tensor]]:
    """Each MoE layer's routing map ([tokens, experts], tokens in megatron's [s, b] order), by layer index."""
    routed: dict[int, list[torch.Tensor]] = {}
    for layer in model.decoder.layers:
        index = layer.layer_number - 1

        def keep(module, args, output, index=index):
            routed.setdefault(index, []).append(output[1].detach().clone())

        layer.mlp.router.register_forward_hook(keep)
    return routed


def transformers_forward(cfg, state: dict, tmp_path):
    """Per row (its real tokens alone): transformers' log-probs of the next tokens and each MoE layer's top-k."""
    from gspo_megatron.policy.models.hf_checkpoint import write_hf_checkpoint

    _, model_class = cfg.architecture.transformers_classes()
    write_hf_checkpoint([list(state.items())], cfg, tmp_path / "hf")
    model = model_class.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    rows = fixed_rows(cfg)
    results = []
    with torch.no_grad():
        for row, length in zip(rows, LENGTHS, strict=True):
            out = model(row[None, :length], output_router_logits=True)
            log_probs = torch.log_softmax(out.logits[0].float(), dim=-1).gather(-1, row[1 : length + 1, None])
            top_k = [logits.topk(cfg.top_k, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits]
            results.append((log_probs.squeeze(-1), top_k))
    return results


@pytest.mark.parametrize("family", sorted(HYBRID_FAMILY_TEST_OVERRIDES))
def test_hybrid_family_round_trips_and_equals_transformers_on_one_rank(tmp_path, family):
    cfg = tiny_family_config(family)
    state = random_hf_state(cfg, seed=3)
    (result,) = run_distributed(megatron_worker, 1, cfg, state, timeout=300)
    assert result["attention"] == ["GatedDeltaNet", "GatedDeltaNet", "SelfAttention"]

    assert result["exported"].keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(result["exported"][name], tensor), name  # bit-exact

    batch = len(LENGTHS)
    for row, (log_probs, top_k) in enumerate(transformers_forward(cfg, state, tmp_path)):
        length = LENGTHS[row]
        torch.testing.assert_close(result["log_probs"][row, :length], log_probs, rtol=1e-4, atol=1e-5)
        for layer, expected in enumerate(top_k):
            (routing_map,) = result["routed"][layer]
            tokens = routing_map.reshape(-1, batch, cfg.num_experts)[:length, row]  # megatron's [s, b] order
            chosen = tokens.nonzero()[:, 1].reshape(length, cfg.top_k)
            assert torch.equal(chosen, expected), f"layer {layer} row {row}"


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILY_TEST_OVERRIDES))
def one_rank(request):
    cfg = tiny_family_config(request.param)
    state = random_hf_state(cfg, seed=4)
    (single,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1), timeout=300)
    return cfg, state, single


HYBRID_LAYOUTS = {
    "tp2": EQUIVALENCE_LAYOUTS["tp2"],
    "ep2": EQUIVALENCE_LAYOUTS["ep2"],
    "tp2_ep2": EQUIVALENCE_LAYOUTS["tp2_ep2"],
    # 3 layers: a gated DeltaNet layer on the first stage; the other and the full-attention layer on the second
    "pp2": dict(pp=2, first_stage_layers=1, world_size=2),
    # megatron-core 0.19: each rank's load-balanced half of the sequence becomes half the linear-attention heads
    "cp2": EQUIVALENCE_LAYOUTS["cp2"],
}
needs_context_parallel = pytest.mark.skipif(
    not gated_delta_net_has_context_parallel(), reason="megatron-core < 0.19: gated DeltaNet has no context parallelism"
)


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=[needs_context_parallel] if "cp" in name else []) for name in HYBRID_LAYOUTS]
)
def test_hybrid_layouts_equal_one_rank(one_rank, layout):
    cfg, state, single = one_rank
    kwargs = HYBRID_LAYOUTS[layout]
    results = run_distributed(model_layout_worker, kwargs["world_size"], cfg, state, kwargs, timeout=600)
    log_probs = {}
    for result in results:
        assert all(torch.equal(result["exported"][name], tensor) for name, tensor in state.items())
        log_probs.update(result["log_probs"])  # the last stage's ranks, by data-parallel rank
        for name, grad in single["grads"].items():
            # The hybrids' gradients reach O(1) (gated DeltaNet's b/a projections); measured differences from one
            # rank were at most 7.1e-6 of each tensor's largest entry (fp32 summation order; Qwen3-Next, ep2), so
            # the absolute floor scales with it; a wrong shard or mapping differs by O(1) of it
            floor = 3e-5 * grad.abs().max().item()
            message = lambda m, n=name: f"{n}: {m}"
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=floor, msg=message)
    merged = torch.cat([log_probs[rank] for rank in sorted(log_probs)], dim=0)
    torch.testing.assert_close(merged, single["log_probs"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(gated_delta_net_has_context_parallel(), reason="megatron-core >= 0.19 runs it (the cp2 layout)")
def test_context_parallelism_is_refused_by_name_where_megatron_has_none():
    with pytest.raises(LayoutError, match=r"parallel\.cp = 2: gated DeltaNet .* set parallel\.cp=1, or install"):
        ParallelLayout(cp=2, world_size=2).validate(tiny_family_config("qwen3_next"))


@needs_context_parallel
def test_linear_attention_heads_that_tp_times_cp_does_not_divide_are_refused_by_name():
    """megatron-core 0.19 asserts linear_num_key_heads % (tp * cp) == 0 inside TransformerConfig; refused first,
    by key: the tiny models' 2 key heads split over tp2 x cp2 = 4 ranks."""
    with pytest.raises(LayoutError, match=r"model\.linear_num_key_heads = 2 is not divisible by parallel\.tp\*cp = 4"):
        ParallelLayout(tp=2, cp=2, world_size=4).validate(tiny_family_config("qwen3_next"))
