"""Every rule of ``ParallelLayout.validate``: valid layouts pass, each invalid one is refused with a
message that names the conflicting numbers (what a user needs to fix the YAML)."""

from __future__ import annotations

import re

import pytest

from gspo_megatron.models.config import MoEModelConfig, preset
from gspo_megatron.parallel.layout import LayoutError, ParallelLayout


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
