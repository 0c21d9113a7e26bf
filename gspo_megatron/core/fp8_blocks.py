"""Block-wise FP8 weights, the format FP8 checkpoints and SGLang's FP8 loader use (DeepSeek-V3, Qwen3-*-FP8).

Format (SGLang 0.5.23 ``layers/quantization/fp8.py``: ``Fp8LinearMethod.create_weights`` registers, for a
block-quantized checkpoint, ``weight`` in float8_e4m3fn and ``weight_scale_inv`` in float32 shaped
[ceil(out / 128), ceil(in / 128)]; ``fp8_utils.py:block_quant_dequant`` reads them back as
w = fp8(q) * s, each 128 x 128 block with its own s; the checkpoint's ``config.json`` says
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``):

    s_b = max(amax_b / 448, tiny)        amax_b = max |w| over block b; 448 = e4m3's largest finite value
    q   = e4m3( w / s_b )                round to nearest; |w / s_b| <= 448 by construction
    w~  = q * s_b                        relative rounding of e4m3 (3 mantissa bits): |w~ - w| <= 2^-4 |w|
                                         for normal values, and <= s_b * 2^-10 near zero (subnormals)

Which tensors: the linear projections SGLang quantizes -- every ``*_proj.weight`` (attention q/k/v/o and the MLA
projections, dense, shared and per-expert MLP gate/up/down). Kept in their dtype, as in the published FP8
checkpoints: embeddings, the LM head, norms, biases, routers (``mlp.gate``), the shared expert's gate, the expert
bias.

``quantize_named_tensors`` turns an HF-named weight stream into the FP8 checkpoint's stream (``<name>`` in e4m3
and ``<name>_scale_inv`` beside it); ``fake_quantize_named_tensors`` gives each quantized weight back as
``w~`` in its own dtype, which is what an engine serving the FP8 weights multiplies with (the embedded engine's
emulation).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gspo_megatron.core.named_tensors import NamedTensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
_TINY = 1e-12  # an all-zero block's scale (its values quantize to 0 whatever it is)

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
}


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether an HF weight is one an FP8 checkpoint stores in e4m3: a 2-D ``*_proj.weight``."""
    return tensor.dim() == 2 and name.endswith("_proj.weight")


def scale_name(name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv``."""
    return name + SCALE_SUFFIX


def _blocks(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [out, in], float32 scales [ceil(out / bn), ceil(in / bk)]) of a 2-D weight (module docstring)."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    nb, kb = _blocks(rows, cols, block)
    padded = torch.zeros(nb * block[0], kb * block[1], dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(nb, block[0], kb, block[1])
    amax = tiles.abs().amax(dim=(1, 3))  # [nb, kb]
    scale = (amax / FP8_MAX).clamp_min(_TINY)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block[0], kb * block[1])[:rows, :cols].contiguous(), scale


def dequantize_block_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """q * s per block, in ``dtype`` (SGLang's ``block_quant_dequant``)."""
    rows, cols = q.shape
    expanded = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:rows, :cols]
    return (q.float() * expanded).to(dtype)


def quantize_named_tensors(tensors: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
    """An HF weight stream as an FP8 checkpoint's: each quantized weight in e4m3, its scales after it."""
    for name, tensor in tensors:
        if is_quantized(name, tensor):
            q, scale = quantize_block_fp8(tensor)
            yield name, q
            yield scale_name(name), scale
        else:
            yield name, tensor


def fake_quantize_named_tensors(tensors: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
    """An HF weight stream with each quantized weight replaced by its FP8 round trip, in its own dtype."""
    for name, tensor in tensors:
        if is_quantized(name, tensor):
            q, scale = quantize_block_fp8(tensor)
            yield name, dequantize_block_fp8(q, scale, tensor.dtype)
        else:
            yield name, tensor


class QuantizedStream:
    """``quantize_named_tensors`` over a re-iterable weight stream: each iteration quantizes a fresh pass (a
    failed sync retried through the disk path reads the source again)."""

    def __init__(self, source: Iterable[NamedTensor]):
        self.source = source

    def __iter__(self) -> Iterator[NamedTensor]:
        return quantize_named_tensors(self.source)
