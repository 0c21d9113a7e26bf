"""The planner on the hybrid families (Qwen3-Next, Qwen3.5-MoE: gated DeltaNet linear attention beside gated full
attention): every parameter counted, the linear layers' activations and the engine's constant-size recurrent
state, and the verdicts for Qwen3.5-35B-A3B on 8 H100s and Qwen3.5-397B-A17B on 64 (issue 62, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config
from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.testing.model_fixtures import tiny_family_config
from planning.activations import MicroBatchShape, activation_bytes
from planning.hardware import gpu_spec
from planning.parameters import gated_delta_net_parameters, stage_parameters
from planning.planner import PlanOptions, plan_layout
from planning.rl_step_memory import EmbeddedEngineShape, generation_bytes, linear_state_bytes

SHIPPED = Path(__file__).resolve().parents[4] / "tools" / "planning" / "hf_configs"
HYBRIDS = ("qwen3_next", "qwen3_5_moe_text")
REAL = ("qwen3_next_80b_a3b", "qwen3_5_35b_a3b", "qwen3_5_397b_a17b")


def _shipped(name: str) -> MoEModelConfig:
    model = MoEModelConfig.from_hf_config_file(SHIPPED / f"{name}.json")
    model.validate()
    return model


def _planned_total(model: MoEModelConfig) -> int:
    return sum(p.numel for p in stage_parameters(model, ParallelLayout(), 0))


@pytest.mark.parametrize("family", HYBRIDS)
def test_the_planner_counts_every_parameter_of_a_tiny_hybrid_as_the_family_code_does(family):
    model = tiny_family_config(family)
    assert model.linear_attention_layers and len(model.linear_attention_layers) < model.num_layers
    assert _planned_total(model) == model.parameter_count()["total"]


@pytest.mark.parametrize("recipe_model", ["qwen3_5_moe_tiny", "qwen3_next_tiny", "qwen3_5_35b_a3b"])
def test_the_planner_counts_a_shipped_model_config_as_model_section_does(recipe_model):
    section = to_train_config(compose([f"model={recipe_model}"])).model
    assert _planned_total(section) == section.parameter_count()["total"]


@pytest.mark.parametrize("name", REAL)
def test_the_planner_counts_the_real_hybrid_shapes_as_the_family_code_does(name):
    model = _shipped(name)
    assert _planned_total(model) == model.parameter_count()["total"]


def test_the_shipped_shapes_are_the_named_models_sizes():
    # (total, active) in billions as the model names state them; Qwen3.5's vision tower (< 1B) is not counted
    for name, total, active in [
        ("qwen3_next_80b_a3b", 80, 3),
        ("qwen3_5_35b_a3b", 35, 3),
        ("qwen3_5_397b_a17b", 397, 17),
    ]:
        counts = _shipped(name).parameter_count()
        assert round(counts["total"] / 1e9) in (total - 1, total), name
        assert int(counts["active"] / 1e9) == active, name


def test_a_gated_delta_net_layer_on_two_tensor_ranks_by_hand():
    model = tiny_family_config("qwen3_5_moe_text")
    h, key_width = model.hidden_size, model.linear_num_key_heads * model.linear_key_head_dim
    heads, dv = model.linear_num_value_heads, model.linear_value_head_dim
    conv = 2 * key_width + heads * dv  # q, k, v channels of the causal conv
    assert dict(gated_delta_net_parameters(model, tp=2)) == {
        "dt_bias": heads // 2,
        "A_log": heads // 2,
        "in_proj.weight": (conv + heads * dv + 2 * heads) // 2 * h,  # q, k, v, z, b, a
        "conv1d.weight": conv // 2 * model.linear_conv_kernel_dim,
        "out_norm.weight": dv,
        "out_proj.weight": h * heads * dv // 2,
    }
    layout = ParallelLayout(tp=2, world_size=2).validate(model)
    names = [p.name for p in stage_parameters(model, layout, 0)]
    linear = model.linear_attention_layers[0]
    full = next(i for i in range(model.num_layers) if i not in model.linear_attention_layers)
    assert f"decoder.layers.{linear}.self_attention.in_proj.weight" in names
    assert f"decoder.layers.{linear}.self_attention.linear_qkv.weight" not in names
    assert f"decoder.layers.{full}.self_attention.linear_qkv.weight" in names


def test_the_engines_linear_attention_state_is_constant_in_the_sequence_length_by_hand():
    model = tiny_family_config("qwen3_5_moe_text")
    engine = EmbeddedEngineShape("float32", max_batch_size=4)
    w, rows, prompt = 4, 4, 8
    key_width = model.linear_num_key_heads * model.linear_key_head_dim
    conv_channels = 2 * key_width + model.linear_num_value_heads * model.linear_value_head_dim
    per_row = conv_channels * model.linear_conv_kernel_dim * w + (
        model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim * 4
    )
    assert linear_state_bytes(model, rows, w) == len(model.linear_attention_layers) * rows * per_row
    # decoding dominates here: each further token adds K and V on the full-attention layers only
    full_layers = model.num_layers - len(model.linear_attention_layers)
    kv_token = 2 * full_layers * rows * model.num_kv_heads * model.head_dim * w
    short, long = (generation_bytes(model, engine, rows, prompt, n) for n in (4000, 5000))
    assert long - short == 1000 * kv_token


def test_a_linear_layers_activations_grow_linearly_with_the_sequence():
    model = tiny_family_config("qwen3_next")
    layout = ParallelLayout()
    linear = model.linear_attention_layers[0]
    full = next(i for i in range(model.num_layers) if i not in model.linear_attention_layers)
    one, two = (activation_bytes(model, layout, MicroBatchShape(1, s), 0).per_layer for s in (256, 512))
    assert two[linear] == 2 * one[linear]  # no s^2 term: no attention matrix, no cache of the whole sequence
    assert one[linear] != one[full]  # counted as a gated DeltaNet, not as the full attention beside it


def test_qwen3_5_35b_a3b_recipe_fits_8_h100s_colocated():
    from planning.job import compose_job, plan_job

    job = compose_job(["+experiment=qwen3_5_35b_a3b_8xh100", "rollout.sglang.model_path=/ckpt"], 8, 1024)
    assert job.options.layer_spec == "portable"  # what the trainer builds the hybrid with
    plan = plan_job(job, gpu_spec("h100"))
    assert plan.fits, plan.problems
    assert plan.total_gpus == 8 and plan.rollout_gpus == 0


def test_qwen3_5_397b_a17b_fits_64_h100s_with_adam_on_the_host_and_not_without():
    """The verdict ``tools/plan.py qwen3_5_397b_a17b tp2_pp8_ep8_etp1_last4 --gpus 64 --recompute
    --optimizer-offload --precision-aware`` prints (the best-ranked layout of 64 GPUs)."""
    model = _shipped("qwen3_5_397b_a17b")
    layout = ParallelLayout(tp=2, pp=8, ep=8, etp=1, last_stage_layers=4, world_size=64).validate(model)
    offloaded = PlanOptions(
        layer_spec="portable", recompute=True, optimizer_offload=1.0, precision_aware=True, dtype="bfloat16"
    )
    assert plan_layout(model, layout, offloaded, gpu_spec("h100")).fits
    on_device = PlanOptions(layer_spec="portable", recompute=True, dtype="bfloat16")
    assert not plan_layout(model, layout, on_device, gpu_spec("h100")).fits
