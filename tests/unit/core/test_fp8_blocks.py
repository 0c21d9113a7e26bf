"""Block FP8 quantization by hand (``core/fp8_blocks.py``), on blocks of 2 x 2 so a 3 x 3 weight has a full block,
two partial ones and a corner: each block's scale is its amax / 448, each value w / s rounded to e4m3."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.core.fp8_blocks import (
    FP8_DTYPE,
    dequantize_block_fp8,
    fake_quantize_named_tensors,
    quantize_block_fp8,
    quantize_named_tensors,
)

# block (0,0): amax 4, s = 4/448 = 1/112: w/s = 448, 112, 56, -224 (each e4m3 exactly: 1.75 x 2^k)
# block (0,1): [1.0; 0.3], amax 1, s = 1/448: 0.3 * 448 = 134.4 lies between e4m3's 128 and 144 -> 128
# block (1,0): [3.0, 0.0], amax 3, s = 3/448: 448 and 0
# block (1,1): [0.0], all zero: s = 1e-12 (any), q = 0
WEIGHT = torch.tensor([[4.0, 1.0, 1.0], [0.5, -2.0, 0.3], [3.0, 0.0, 0.0]])


def test_scales_and_values_by_hand():
    q, scale = quantize_block_fp8(WEIGHT, block=(2, 2))
    assert q.dtype == FP8_DTYPE and q.shape == (3, 3) and scale.shape == (2, 2) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([[4 / 448, 1 / 448], [3 / 448, 1e-12]]))
    assert q.float().tolist() == [[448.0, 112.0, 448.0], [56.0, -224.0, 128.0], [448.0, 0.0, 0.0]]
    back = dequantize_block_fp8(q, scale, block=(2, 2))
    expected = WEIGHT.clone()
    expected[1, 2] = 128 / 448  # 0.3 came back as 0.2857
    torch.testing.assert_close(back, expected)


def test_relative_rounding_within_e4m3s_half_step():
    """Normal values come back within 2^-4 of themselves (3 mantissa bits), a block's tiny values within
    s * 2^-10 (e4m3's subnormal step 2^-9, halved)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g) * torch.logspace(-3, 1, 260).unsqueeze(0)
    q, scale = quantize_block_fp8(w)
    back = dequantize_block_fp8(q, scale)
    s = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    assert ((back - w).abs() <= torch.maximum(2.0**-4 * w.abs(), s * 2.0**-10) * (1 + 1e-6)).all()


def test_streams_quantize_only_the_projections():
    named = [
        ("model.embed_tokens.weight", torch.randn(8, 4)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4)),
        ("model.layers.0.input_layernorm.weight", torch.ones(4)),
        ("model.layers.0.mlp.gate.weight", torch.randn(2, 4)),  # the router stays
        ("model.layers.0.mlp.experts.1.down_proj.weight", torch.randn(4, 3)),
        ("lm_head.weight", torch.randn(8, 4)),
    ]
    out = list(quantize_named_tensors(named))
    names = [name for name, _ in out]
    assert names == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.1.down_proj.weight",
        "model.layers.0.mlp.experts.1.down_proj.weight_scale_inv",
        "lm_head.weight",
    ]
    dtypes = {name: t.dtype for name, t in out}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == FP8_DTYPE
    assert dtypes["model.layers.0.mlp.gate.weight"] == torch.float32
    fake = dict(fake_quantize_named_tensors(named))
    assert list(fake) == [name for name, _ in named] and all(t.dtype == torch.float32 for t in fake.values())
    assert torch.equal(fake["lm_head.weight"], named[-1][1])
    q_proj = named[1][1]
    assert not torch.equal(fake["model.layers.0.self_attn.q_proj.weight"], q_proj)
    torch.testing.assert_close(fake["model.layers.0.self_attn.q_proj.weight"], q_proj, rtol=2.0**-4, atol=1e-3)


def test_a_non_matrix_is_refused():
    with pytest.raises(ValueError, match="2-D weights"):
        quantize_block_fp8(torch.ones(4))
