"""Write one ``.safetensors`` file straight from tensors, durably, without copying them first.

The format (huggingface/safetensors, ``docs``/``README``): 8 bytes little-endian header length N,
N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
(padded with spaces to a multiple of 8), then the tensors' bytes at those offsets. ``safetensors``'
own ``save_file`` first builds the whole file in memory (and refuses tensors that share storage, so
callers clone); here each tensor's bytes go to the file descriptor directly from its own memory,
and ``fdatasync`` makes the file durable before the caller renames it into place.

Readers (safetensors, transformers, SGLang) accept any tensor order as long as the offsets tile the
data region, which writing in order guarantees.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> int:
    """Write ``tensors`` to ``path`` and fdatasync it; returns the bytes of tensor data written."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian data; this writer runs on little-endian hosts only")
    header: dict[str, object] = {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(text)) + text))
        for tensor in tensors.values():
            if tensor.numel():
                _write_all(fd, _bytes_of(tensor))
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return offset


def fsync_directory(directory: str | Path) -> None:
    """Make renames and new entries in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order: its own memory when it is a contiguous CPU tensor."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy().data)  # ndarray.data: the buffer itself


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]
