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


def _index_naming(directory, shard):
    """A checkpoint in ``directory`` whose index names ``shard`` for tensor ``a``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": str(shard)}}))


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_shard_outside_the_checkpoint_is_refused(tmp_path, how):
    """Issue 63 item 3: a shard the index names by absolute path, through ``..`` or through a symlink that
    leads out of the directory is refused, naming the index, the entry and why (it was read, silently)."""
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"a": torch.randn(4)}, str(outside))
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    entry = {"absolute": str(outside), "dotdot": "../elsewhere.safetensors", "symlink": "linked.safetensors"}[how]
    if how == "symlink":
        (checkpoint / "linked.safetensors").symlink_to(outside)
    _index_naming(checkpoint, entry)
    why = {"absolute": "an absolute path", "dotdot": "a path through ..", "symlink": "resolves through a symlink"}[how]
    with pytest.raises(ConversionError) as refused:
        SafetensorsSource(checkpoint)
    message = str(refused.value)
    assert "model.safetensors.index.json" in message and repr(entry) in message and why in message


def test_single_file_symlinked_outside_is_refused(tmp_path):
    save_file({"a": torch.randn(4)}, str(tmp_path / "elsewhere.safetensors"))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ConversionError, match=r"model.safetensors, which resolves through a symlink to .*elsewhere"):
        SafetensorsSource(tmp_path / "ckpt")


def test_symlinks_inside_the_checkpoint_and_the_hub_cache_layout_load(tmp_path):
    """A link that stays inside the directory is fine, and so is the hub cache's snapshots/<rev>/ -> blobs/."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    save_file({"a": torch.randn(4)}, str(checkpoint / "real.safetensors"))
    (checkpoint / "linked.safetensors").symlink_to("real.safetensors")
    _index_naming(checkpoint, "linked.safetensors")
    assert SafetensorsSource(checkpoint).get("a").shape == (4,)
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    save_file({"a": torch.randn(4)}, str(repo / "blobs" / "0123abcd"))
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123abcd")
    assert SafetensorsSource(snapshot).get("a").shape == (4,)
