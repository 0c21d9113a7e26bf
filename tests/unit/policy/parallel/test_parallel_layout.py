"""Every rule of ``ParallelLayout.validate``: valid layouts pass, each invalid one is refused with a
message that names the conflicting numbers (what a user needs to fix the YAML)."""

from __future__ import annotations

import re

import pytest
import torch

from gspo_megatron.policy.models.config import MoEModelConfig, preset
from gspo_megatron.policy.parallel.layout import LayoutError, ParallelLayout


def tiny(**overrides) -> MoEModelConfig:
    values = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=8,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=16,
    )
    values.update(overrides)
    return MoEModelConfig(**values)  # validated as it is built


def refused(layout: ParallelLayout, *fragments: str, model=None) -> str:
    with pytest.raises(LayoutError) as info:
        layout.validate(model)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# --- derived sizes --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, dp, expert_dp",
    [
        (dict(world_size=1), 1, 1),
        (dict(tp=2, world_size=8), 4, 4),  # etp defaults to tp
        (dict(tp=2, pp=2, cp=2, world_size=16), 2, 4),
        (dict(tp=2, ep=4, etp=1, world_size=8), 4, 2),  # MoE folding: ep need not divide dp
        (dict(tp=4, ep=8, etp=1, world_size=32), 8, 4),
    ],
)
def test_derived_data_parallel_sizes(kwargs, dp, expert_dp):
    layout = ParallelLayout(**kwargs).validate()
    assert (layout.dp, layout.expert_dp) == (dp, expert_dp)
    # both meshes tile the whole world
    assert layout.tp * layout.pp * layout.cp * layout.dp == layout.world_size
    assert layout.expert_tp * layout.ep * layout.pp * layout.expert_dp == layout.world_size


def test_expert_tp_defaults_to_tp_and_can_differ():
    assert ParallelLayout(tp=4, world_size=4).expert_tp == 4
    assert ParallelLayout(tp=4, etp=1, world_size=4).expert_tp == 1


@pytest.mark.parametrize(
    "tp, requested, expected", [(1, None, False), (2, None, True), (2, False, False), (2, True, True)]
)
def test_sequence_parallel_default_follows_tp(tp, requested, expected):
    assert ParallelLayout(tp=tp, sequence_parallel=requested, world_size=tp).use_sequence_parallel is expected


def test_validate_returns_the_layout_for_chaining():
    layout = ParallelLayout(tp=2, ep=2, world_size=4)
    assert layout.validate(tiny()) is layout


# --- sizes themselves -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tp", "pp", "ep", "cp", "world_size"])
@pytest.mark.parametrize("value", [0, -2, 1.5, "2"])
def test_sizes_must_be_positive_integers(name, value):
    refused(ParallelLayout(**{name: value}), f"parallel.{name}", repr(value))


@pytest.mark.parametrize("value", [0, -1, 2.0])
def test_etp_must_be_positive_or_null(value):
    refused(ParallelLayout(etp=value), "parallel.etp", repr(value), "or null")


# --- world size ---------------------------------------------------------------------------
def test_dense_mesh_must_divide_world():
    message = refused(ParallelLayout(tp=2, pp=2, cp=1, world_size=6), "tp*pp*cp", "2*2*1 = 4", "world size 6")
    assert "divides" in message


def test_context_parallel_counts_in_the_dense_mesh():
    refused(ParallelLayout(tp=1, pp=1, cp=4, world_size=6), "1*1*4 = 4", "world size 6")


def test_expert_mesh_must_divide_world():
    # dense mesh fine (tp=2 divides 6), expert mesh etp*ep*pp = 2*2*1 = 4 does not
    refused(ParallelLayout(tp=2, ep=2, world_size=6), "etp*ep*pp", "2*2*1 = 4", "world size 6", "lower ep or etp")


def test_expert_mesh_uses_explicit_etp():
    ParallelLayout(tp=2, ep=4, etp=1, world_size=4).validate()  # 1*4*1 divides 4
    refused(ParallelLayout(tp=2, ep=4, etp=2, world_size=4), "2*4*1 = 8", "world size 4")


def test_sequence_parallel_needs_tensor_parallel():
    refused(ParallelLayout(tp=1, sequence_parallel=True, world_size=2), "sequence_parallel=true", "tp > 1")
    ParallelLayout(tp=1, sequence_parallel=False, world_size=2).validate()


# --- against the model --------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout, model, field, value, dim, size",
    [
        (dict(pp=3, world_size=3), tiny(num_layers=4), "num_layers", 4, "pp", 3),
        (
            dict(tp=3, world_size=3),
            tiny(num_attention_heads=4, num_kv_heads=4, vocab_size=96),
            "num_attention_heads",
            4,
            "tp",
            3,
        ),
        (dict(tp=4, world_size=4), tiny(num_attention_heads=8, num_kv_heads=2), "num_kv_heads", 2, "tp", 4),
        (dict(tp=2, world_size=2), tiny(vocab_size=65), "vocab_size", 65, "tp", 2),
        (dict(ep=3, world_size=3), tiny(num_experts=8), "num_experts", 8, "ep", 3),
        (dict(tp=2, etp=3, world_size=6), tiny(moe_intermediate_size=16), "moe_intermediate_size", 16, "etp", 3),
        (
            dict(tp=2, etp=1, world_size=2),
            tiny(dense_layers=[0], dense_intermediate_size=33),
            "dense_intermediate_size",
            33,
            "tp",
            2,
        ),
    ],
)
def test_model_dimension_must_divide(layout, model, field, value, dim, size):
    message = refused(ParallelLayout(**layout), model=model)
    assert f"model.{field} = {value}" in message
    assert f"parallel.{dim} = {size}" in message


def test_attention_heads_mismatch_is_reported_before_kv_heads():
    # both 6 q heads and 3 kv heads fail tp=4; the first check names the q heads
    message = refused(ParallelLayout(tp=4, world_size=4), model=tiny(num_attention_heads=6, num_kv_heads=3))
    assert "num_attention_heads = 6" in message


def test_expert_checks_skipped_for_a_dense_model():
    dense = tiny(num_experts=0, dense_layers=[0, 1, 2, 3], dense_intermediate_size=32)
    assert not dense.is_moe
    ParallelLayout(ep=3, world_size=3).validate(dense)  # 8 experts would not divide 3 if they counted


def test_moe_with_tensor_parallel_needs_sequence_parallel():
    message = refused(ParallelLayout(tp=2, sequence_parallel=False, world_size=2), model=tiny())
    assert "tp = 2" in message and "sequence_parallel=true" in message
    ParallelLayout(tp=2, world_size=2).validate(tiny())  # default turns it on


def test_real_qwen3_30b_layouts():
    model = preset("qwen3_30b_a3b")
    layout = ParallelLayout(tp=4, ep=8, etp=1, world_size=32).validate(model)
    assert (layout.dp, layout.expert_dp) == (8, 4)
    # 4 KV heads cannot be split over 8 TP ranks
    message = refused(ParallelLayout(tp=8, world_size=8), model=model)
    assert re.search(r"num_kv_heads = 4 .* parallel\.tp = 8", message)
    # 48 layers over 5 stages
    refused(ParallelLayout(pp=5, world_size=5), "num_layers = 48", "parallel.pp = 5", model=model)


# --- pipeline stages ------------------------------------------------------------------------
STAGE_LAYOUTS = [
    dict(pp=2),
    dict(pp=2, first_stage_layers=3),
    dict(pp=2, last_stage_layers=1),
    dict(pp=4, last_stage_layers=1, num_layers=10),  # slime's 235B shape: 3 + 3 + 3 + 1
    dict(pp=4, first_stage_layers=2, last_stage_layers=2, num_layers=10),
    dict(pp=2, vpp=2),
    dict(pp=2, vpp=2, first_stage_layers=2, num_layers=10),
    dict(pp=3, vpp=2, first_stage_layers=2, last_stage_layers=4, num_layers=12),
]


@pytest.mark.parametrize("spec", STAGE_LAYOUTS, ids=lambda s: "_".join(f"{k}{v}" for k, v in s.items()))
def test_stage_layers_are_megatrons(spec):
    """Which layers each pipeline rank (and each of its virtual chunks) holds is exactly what megatron-core
    builds: ``get_num_layers_to_build`` and ``get_transformer_layer_offset`` for every rank and chunk."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    spec = dict(spec)
    num_layers = spec.pop("num_layers", 4)
    layout = ParallelLayout(world_size=spec["pp"], **spec).validate(tiny(num_layers=num_layers))
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        pipeline_dtype=torch.float32,
    )
    chunks = range(layout.vpp) if layout.vpp > 1 else [None]
    for rank in range(layout.pp):
        megatron_layers = []
        for chunk in chunks:
            offset = get_transformer_layer_offset(config, vp_stage=chunk, pp_rank=rank)
            count = get_num_layers_to_build(config, vp_stage=chunk, pp_rank=rank)
            megatron_layers += list(range(offset, offset + count))
        assert layout.stage_layers(num_layers, rank) == megatron_layers, rank
    assert sorted(sum((layout.stage_layers(num_layers, r) for r in range(layout.pp)), [])) == list(range(num_layers))


@pytest.mark.parametrize(
    "spec, fragments",
    [
        (dict(pp=1, first_stage_layers=2), ["parallel.first_stage_layers = 2 needs parallel.pp > 1"]),
        (dict(pp=2, last_stage_layers=0), ["parallel.last_stage_layers must be a positive integer"]),
        (dict(pp=2, first_stage_layers=4), ["first_stage_layers=4", "remaining 0 layers"]),
        (dict(pp=3, last_stage_layers=1), ["other 2 stages cannot share the remaining 3 layers"]),
        (dict(pp=2, vpp=2, first_stage_layers=3), ["pipeline rank 0 holds 3 layers, not a multiple of vpp = 2"]),
        (dict(pp=1, vpp=2), ["vpp = 2 needs pp > 1"]),
    ],
)
def test_uneven_stages_that_cannot_split_are_refused(spec, fragments):
    refused(ParallelLayout(world_size=spec["pp"], **spec), *fragments, model=tiny(num_layers=4))
