"""The real Qwen3-30B-A3B shape builds as a megatron GPTModel on the meta device (one gloo rank):
its parameter count equals ``MoEModelConfig.parameter_count()["total"]`` (30.53B), every parameter
is on ``meta``, resident memory barely grows (fp32 weights would be ~122 GB), and the HF mapping
table covers each of the model's parameters with the shapes of the HF checkpoint.

The build runs in a spawned rank so megatron's parallel state never touches the test process.
"""

from __future__ import annotations

import math

import pytest

from gspo_megatron.policy.models.config import preset
from gspo_megatron.testing.distributed import run_distributed

MAX_RSS_GROWTH_BYTES = 512 << 20  # the 30B fp32 weights are 122 GB: any real allocation shows


def meta_build_worker(ctx, preset_name: str) -> dict:
    import psutil

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model, count_parameters
    from gspo_megatron.policy.models.conversion import build_mappings, hf_shapes
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.policy.routing.replay import RoutingReplay

    cfg = preset(preset_name)
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout)
    process = psutil.Process()
    rss_before = process.memory_info().rss
    replay_before = RoutingReplay.instance_count()
    model = build_model(cfg, layout, device="meta", layer_spec="portable")
    rss_growth = process.memory_info().rss - rss_before
    params = dict(model.named_parameters())
    shapes = hf_shapes(cfg)
    mapped: dict[str, int] = {}
    mismatched = []
    for row in build_mappings(model, cfg):
        hf_numel = sum(math.prod(shapes[name]) for name in row.hf_names)
        if hf_numel != params[row.megatron_name].numel():
            mismatched.append((row.megatron_name, hf_numel, params[row.megatron_name].numel()))
        for name in row.hf_names:
            mapped[name] = mapped.get(name, 0) + 1
    out = {
        "parameters": count_parameters(model),
        "devices": sorted({p.device.type for p in params.values()}),
        "dtypes": sorted({str(p.dtype) for p in params.values()}),
        "rss_growth": rss_growth,
        "routers": RoutingReplay.instance_count() - replay_before,
        "hf_names": sorted(shapes),
        "mapped": mapped,
        "mismatched": mismatched,
        "topk": model.config.moe_router_topk,
        "experts": model.config.num_moe_experts,
    }
    mesh.destroy()
    return out


@pytest.fixture(scope="module")
def qwen3_30b_on_meta():
    (result,) = run_distributed(meta_build_worker, 1, "qwen3_30b_a3b", timeout=600)
    return result


def test_parameter_count_equals_config(qwen3_30b_on_meta):
    expected = preset("qwen3_30b_a3b").parameter_count()["total"]
    assert expected == 30_532_122_624
    assert qwen3_30b_on_meta["parameters"] == expected


def test_nothing_is_allocated(qwen3_30b_on_meta):
    assert qwen3_30b_on_meta["devices"] == ["meta"]
    assert qwen3_30b_on_meta["dtypes"] == ["torch.float32"]
    assert qwen3_30b_on_meta["rss_growth"] < MAX_RSS_GROWTH_BYTES, (
        f"building on meta grew RSS by {qwen3_30b_on_meta['rss_growth'] / 2**20:.0f} MiB"
    )


def test_moe_shape(qwen3_30b_on_meta):
    assert (qwen3_30b_on_meta["experts"], qwen3_30b_on_meta["topk"]) == (128, 8)
    assert qwen3_30b_on_meta["routers"] == 48  # one RouterReplay per MoE layer, all 48 layers are MoE


def test_every_hf_tensor_is_mapped_once_with_matching_size(qwen3_30b_on_meta):
    mapped = qwen3_30b_on_meta["mapped"]
    assert sorted(mapped) == qwen3_30b_on_meta["hf_names"]
    assert set(mapped.values()) == {1}
    assert qwen3_30b_on_meta["mismatched"] == []
    # 48 layers x 128 experts x 3 projections of the real checkpoint
    assert sum(".mlp.experts." in name for name in mapped) == 48 * 128 * 3
