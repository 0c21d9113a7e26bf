"""The project's block-FP8 weights (``core/fp8_blocks.py``) read by SGLang's own FP8 code: its config parser
takes the quantization config, its dequantization gives the weights back within FP8's rounding, and its
block-scale parameter has the shape of the project's scales."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.core.fp8_blocks import QUANTIZATION_CONFIG, quantize_block_fp8, quantize_named_tensors

pytestmark = pytest.mark.contract


def test_sglang_parses_the_quantization_config(sglang_reference):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    config = Fp8Config.from_config(dict(QUANTIZATION_CONFIG))
    assert config.is_checkpoint_fp8_serialized and config.weight_block_size == [128, 128]
    assert config.activation_scheme == "dynamic"


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (768, 64)])
def test_sglangs_dequantization_gives_the_weights_back_within_fp8_rounding(sglang_reference, shape):
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    g = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    q, scale = quantize_block_fp8(weight)
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))  # Fp8LinearMethod's weight_scale_inv
    back = block_quant_dequant(q, scale, [128, 128], torch.float32)
    s = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    bound = torch.maximum(2.0**-4 * weight.float().abs(), s * 2.0**-10) * (1 + 1e-6)
    assert ((back - weight.float()).abs() <= bound).all()


def test_the_stream_names_are_sglangs_parameter_names(sglang_reference):
    """SGLang's FP8 linear registers ``weight`` and ``weight_scale_inv``: a checkpoint name ``<prefix>.weight``
    loads into the first, ``<prefix>.weight_scale_inv`` into the second."""
    stream = dict(quantize_named_tensors([("model.layers.0.self_attn.o_proj.weight", torch.randn(128, 256))]))
    assert set(stream) == {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight_scale_inv"}
    assert stream["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
