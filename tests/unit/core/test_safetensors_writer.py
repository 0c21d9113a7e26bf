"""The streaming safetensors writer against safetensors' own reader (and its own writer's bytes)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gspo_megatron.core.safetensors_writer import SAFETENSORS_DTYPES, write_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(6, 4, generator=g)
    return {
        "b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a.gate": fused[:3],  # two views of one storage: safetensors' save_file refuses these
        "a.up": fused[3:],
        "strided": torch.randn(4, 6, generator=g).t(),  # non-contiguous
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "half": torch.randn(2, 2, generator=g).half(),
    }


def test_safetensors_reads_back_every_tensor_and_the_metadata(tmp_path):
    tensors = _tensors()
    written = write_safetensors(tmp_path / "x.safetensors", tensors, metadata={"format": "pt"})
    assert written == sum(t.numel() * t.element_size() for t in tensors.values())
    loaded = load_file(tmp_path / "x.safetensors")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_the_same_bytes_as_safetensors_save_file_for_its_order(tmp_path):
    # save_file orders tensors by dtype size (descending), then name; in that order the files match
    tensors = {k: v.contiguous().clone() for k, v in _tensors().items() if k != "empty"}
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    write_safetensors(tmp_path / "ours.safetensors", {k: tensors[k] for k in order}, metadata={"format": "pt"})
    ref, ours = (tmp_path / "ref.safetensors").read_bytes(), (tmp_path / "ours.safetensors").read_bytes()
    header = int.from_bytes(ref[:8], "little")
    assert ours[8 + int.from_bytes(ours[:8], "little") :] == ref[8 + header :]  # identical data region


def test_unsupported_dtype_is_refused_naming_the_tensor(tmp_path):
    assert torch.complex64 not in SAFETENSORS_DTYPES
    with pytest.raises(ValueError, match="'z' has dtype torch.complex64"):
        write_safetensors(tmp_path / "z.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
