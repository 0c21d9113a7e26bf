"""A broken checkpoint directory is refused when it is opened, naming the file (not at the first read)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from gspo_megatron.policy.models.weight_sources import ConversionError, SafetensorsSource


def _two_shards(directory):
    save_file({"a": torch.randn(64, 64)}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.randn(64)}, str(directory / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_intact_shards_load(tmp_path):
    _two_shards(tmp_path)
    assert SafetensorsSource(tmp_path).get("b").shape == (64,)


def test_truncated_shard_is_named(tmp_path):
    _two_shards(tmp_path)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])  # a download cut short
    with pytest.raises(ConversionError, match="model-00001-of-00002.safetensors is not a readable safetensors"):
        SafetensorsSource(tmp_path)


def test_missing_shard_is_named(tmp_path):
    _two_shards(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConversionError, match="model-00002-of-00002.safetensors is missing"):
        SafetensorsSource(tmp_path)


def test_truncated_single_file_is_named(tmp_path):
    save_file({"a": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ConversionError, match="model.safetensors is not a readable"):
        SafetensorsSource(tmp_path)
