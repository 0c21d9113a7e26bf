"""Done-when of HF checkpoints: a transformers-written Qwen3-MoE trains and comes back out.

1. ``transformers`` writes a random tiny ``Qwen3MoeForCausalLM`` (save_pretrained, safetensors).
2. The trainer starts from it (``model.hf_checkpoint=<dir>``; the shape comes from its config.json,
   not from the model YAML, which is deliberately different here), trains 2 GSPO steps and exports
   ``<run>/hf_export`` (``checkpoint.export_hf=true``).
3. ``transformers`` loads the export; its logits equal Megatron's logits for the same directory
   within fp32 tolerance, and Megatron re-exports the same tensors bit-exactly. The same holds for
   the original directory, which checks the import.
4. The export is the trainer's final policy: the trainer's own distributed checkpoint, converted
   with ``tools/convert_checkpoint.py``, is bit-identical to it, and it differs from the start.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from gspo_megatron.policy.models.weight_sources import SafetensorsSource
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import FAST, train_worker

pytestmark = pytest.mark.e2e

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"
TOKENS = torch.tensor([[5, 17, 33, 2, 60, 41, 7, 12, 79, 3], [44, 44, 1, 9, 30, 62, 18, 25, 6, 70]])


def write_transformers_checkpoint(directory: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=80,
        hidden_size=48,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.0,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # spread router logits so top-k choices are not near-ties
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(directory)


def megatron_worker(ctx, hf_dir: str, tokens: torch.Tensor):
    """Megatron logits of ``hf_dir``'s weights and whether re-exporting them is bit-exact."""
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.config import MoEModelConfig
    from gspo_megatron.policy.models.conversion import export_hf_state_dict, load_hf_weights
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    cfg = MoEModelConfig.from_hf_config_file(hf_dir)
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout)
    model = build_model(cfg, layout, layer_spec="portable")
    source = SafetensorsSource(hf_dir)
    load_hf_weights(model, cfg, source, mesh)
    exported = export_hf_state_dict(model, cfg, mesh)
    bit_exact = set(exported) == set(source.keys()) and all(torch.equal(v, source.get(k)) for k, v in exported.items())
    model.eval()
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions, attention_mask=None)
    mesh.destroy()
    return {"logits": logits.float(), "bit_exact": bit_exact}


def tool_worker(ctx, argv):
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def transformers_logits(hf_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    source = SafetensorsSource(directory)
    return {k: source.stored(k) for k in source.keys()}  # noqa: SIM118 - keys() only: not a mapping, not iterable


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_roundtrip")
    write_transformers_checkpoint(root / "initial")
    # A random model answers right ~1/80 of the time: 256 responses per step give rewards to learn from.
    overrides = FAST + [
        f"model.hf_checkpoint={root / 'initial'}",
        "checkpoint.export_hf=true",
        "trainer.prompts_per_step=16",
        "rollout.group_size=16",
        "trainer.micro_batch_size=64",
    ]
    (metrics,) = run_distributed(train_worker, 1, overrides, str(root / "run"), timeout=600)
    return root, metrics


def test_training_starts_from_the_checkpoint_and_exports(trained):
    root, metrics = trained
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["loss/policy"])
        # the rollout engine (fed by the export path) agrees with the trainer on the imported weights
        assert m["mismatch/abs_log_prob_diff_mean"] < 1e-4
    assert any(m["reward/mean"] > 0 for m in metrics), "no reward at all: the run could not change the weights"
    export = root / "run" / "hf_export"
    assert (export / "config.json").is_file() and (export / "model.safetensors.index.json").is_file()
    initial, final = _weights(root / "initial"), _weights(export)
    assert final.keys() == initial.keys()
    assert final["model.embed_tokens.weight"].shape == (80, 48)  # the checkpoint's shape, not model=tiny's
    changed = [k for k in initial if not torch.equal(initial[k], final[k])]
    assert len(changed) > len(initial) // 2, f"training changed only {changed}"


@pytest.mark.parametrize("which", ["initial", "run/hf_export"])
def test_transformers_logits_match_megatron(trained, which):
    root, _ = trained
    directory = root / which
    (megatron,) = run_distributed(megatron_worker, 1, str(directory), TOKENS, timeout=300)
    assert megatron["bit_exact"], "HF -> Megatron -> HF changed a tensor"
    reference = transformers_logits(directory)
    assert reference.shape == megatron["logits"].shape == (2, 10, 80)
    torch.testing.assert_close(megatron["logits"], reference, rtol=1e-4, atol=1e-4)


def test_export_is_the_trainers_final_policy(trained):
    root, _ = trained
    step_dir = root / "run" / "checkpoints" / "step_000002"
    run_distributed(
        tool_worker,
        1,
        ["mcore-to-hf", "--mcore-dir", str(step_dir), "--out", str(root / "converted"), "--layer-spec", "portable"],
        timeout=300,
    )
    converted, exported = _weights(root / "converted"), _weights(root / "run" / "hf_export")
    assert converted.keys() == exported.keys()
    for name, value in exported.items():
        assert torch.equal(converted[name], value), name


def test_an_fp8_block_export_holds_the_final_policy_within_fp8_rounding(trained):
    """``mcore-to-hf --fp8-block``: every projection as e4m3 with its 128x128 scales (the rest bit-equal), the
    quantization config SGLang reads, and the FP8-serving check of rollout.sglang.weight_quantization: it takes
    this checkpoint and refuses the bf16 export by name."""
    from gspo_megatron.core.fp8_blocks import FP8_DTYPE, QUANTIZATION_CONFIG, dequantize_block_fp8, scale_name
    from gspo_megatron.rollout.sglang.config import SGLangConfig

    root, _ = trained
    step_dir = root / "run" / "checkpoints" / "step_000002"
    out = root / "converted_fp8"
    argv = ["mcore-to-hf", "--mcore-dir", str(step_dir), "--out", str(out), "--layer-spec", "portable", "--fp8-block"]
    run_distributed(tool_worker, 1, argv, timeout=300)
    fp8, exported = _weights(out), _weights(root / "run" / "hf_export")
    quantized = [name for name in exported if name.endswith("_proj.weight")]
    assert quantized and set(fp8) == set(exported) | {scale_name(name) for name in quantized}
    for name, value in exported.items():
        if name not in quantized:
            assert torch.equal(fp8[name], value), name
            continue
        assert fp8[name].dtype == FP8_DTYPE
        back = dequantize_block_fp8(fp8[name], fp8[scale_name(name)])
        scales = (
            fp8[scale_name(name)]
            .repeat_interleave(128, 0)
            .repeat_interleave(128, 1)[: value.shape[0], : value.shape[1]]
        )
        bound = torch.maximum(2.0**-4 * value.float().abs(), scales * 2.0**-10) * (1 + 1e-6)
        assert ((back - value.float()).abs() <= bound).all(), name
    assert json.loads((out / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG
    SGLangConfig(model_path=str(out), weight_quantization="fp8_block").validate()
    with pytest.raises(ValueError, match="rollout.sglang.weight_quantization=fp8_block sends block-FP8 weights"):
        SGLangConfig(model_path=str(root / "run" / "hf_export"), weight_quantization="fp8_block").validate()
