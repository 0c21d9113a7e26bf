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
from typing import Any

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
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, *, durable: bool = True
) -> int:
    """Write ``tensors`` to ``path`` (and fdatasync it when ``durable``); returns the bytes of tensor data."""
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
        if durable:
            os.fdatasync(fd)
    finally:
        os.close(fd)
    return offset


INDEX_FILE = "model.safetensors.index.json"


class ShardWriter:
    """Accumulate (name, tensor) pairs into safetensors shards of at most ``shard_bytes``."""

    def __init__(self, directory: Path, shard_bytes: int, *, durable: bool = True):
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        self.directory = Path(directory)
        self.shard_bytes = shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # temporary file name, tensor names
        self.total_bytes = 0
        self.durable = durable  # fdatasync every file (False: a copy read back at once, e.g. weight sync)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in names for _, names in self.files):
            raise ValueError(f"tensor {name!r} was exported twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        # device tensors come to host now (a shard of them would otherwise sit in GPU memory);
        # host tensors are kept as they are, views included, and written from their own memory
        self.pending[name] = tensor.detach().to("cpu")
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        file = f"shard-{len(self.files):05d}.tmp"
        write_safetensors(self.directory / file, self.pending, metadata={"format": "pt"}, durable=self.durable)
        self.files.append((file, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> dict[str, Any]:
        """Flush, give the shards their final names, write and return the index."""
        if self.pending:
            self._flush()
        if not self.files:
            raise ValueError("the export produced no tensors")
        count = len(self.files)
        weight_map = {}
        for i, (tmp, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.directory / tmp, self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        if self.durable:
            write_durably(self.directory / INDEX_FILE, text)
        else:
            (self.directory / INDEX_FILE).write_text(text)
        return index


def write_durably(path: Path, text: str) -> None:
    path.write_text(text)
    fsync_path(path)


def fsync_path(path: str | Path) -> None:
    """Make a file's data, or a directory's entries (renames, new files), durable: ``fdatasync`` for a
    file, ``fsync`` for a directory (the call POSIX defines for directory entries)."""
    sync = os.fsync if os.path.isdir(path) else os.fdatasync
    fd = os.open(path, os.O_RDONLY)
    try:
        sync(fd)
    finally:
        os.close(fd)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order: its own memory when it is a contiguous CPU tensor."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy().data)  # ndarray.data: the buffer itself


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]
