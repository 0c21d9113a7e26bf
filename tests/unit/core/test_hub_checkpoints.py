"""Model paths given as hub ids resolve through huggingface_hub's cache (core/hub_checkpoints.py).

Offline by construction: every test switches huggingface_hub's offline mode on and points its cache at a
temporary folder laid out as the hub lays it (``testing/hub_cache.py``). Nothing here downloads; the one
test in online mode points the hub at a loopback port that refuses connections.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from gspo_megatron.config.compose import compose
from gspo_megatron.core.hub_checkpoints import HubCheckpointError, looks_like_hub_id, resolve_model_path
from gspo_megatron.policy.models.hf_checkpoint import hf_shape_fields, write_hf_checkpoint
from gspo_megatron.policy.models.weight_sources import SafetensorsSource
from gspo_megatron.testing.hub_cache import cache_as_the_hub_does, use_offline_hub_cache
from gspo_megatron.testing.model_fixtures import random_hf_state, tiny_test_config
from gspo_megatron.train import resolve_model_paths


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    use_offline_hub_cache(monkeypatch, cache)
    return cache


@pytest.fixture
def tiny_checkpoint(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=3)
    folder = write_hf_checkpoint([list(state.items())], cfg, tmp_path / "folder", shard_bytes=20_000)
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded, with an index: every link is followed
    return folder, state


def test_a_cached_hub_id_loads_exactly_the_folders_weights(hub_cache, tiny_checkpoint):
    folder, state = tiny_checkpoint
    snapshot = cache_as_the_hub_does(folder, hub_cache, "tiny-org/tiny-moe")
    cfg = compose(["model.hf_checkpoint=tiny-org/tiny-moe", "tokenizer.kind=hf", "tokenizer.path=tiny-org/tiny-moe"])
    resolved = resolve_model_paths(cfg)
    assert resolved.model.hf_checkpoint == str(snapshot.resolve())
    assert resolved.tokenizer.path == str(snapshot.resolve())  # the tokenizer path the same way
    assert hf_shape_fields(resolved.model.hf_checkpoint) == hf_shape_fields(folder)
    from_hub, from_folder = SafetensorsSource(resolved.model.hf_checkpoint), SafetensorsSource(folder)
    assert sorted(from_hub.keys()) == sorted(from_folder.keys()) == sorted(state)
    for name in state:
        assert torch.equal(from_hub.get(name), from_folder.get(name)), name


def test_a_hub_id_not_in_the_cache_offline_is_refused_with_the_fix(hub_cache):
    cfg = compose(["model.hf_checkpoint=Qwen/Qwen3-30B-A3B"])
    with pytest.raises(HubCheckpointError) as refused:
        resolve_model_paths(cfg)
    message = str(refused.value)
    print(message)
    assert "model.hf_checkpoint=Qwen/Qwen3-30B-A3B" in message
    assert str(hub_cache) in message and "HF_HUB_OFFLINE" in message
    assert "hf download Qwen/Qwen3-30B-A3B" in message and "local folder" in message


def test_an_existing_local_folder_stays_a_folder_even_when_shaped_like_a_hub_id(hub_cache, tmp_path, monkeypatch):
    (tmp_path / "checkpoints" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("model.hf_checkpoint", "checkpoints/mine") == "checkpoints/mine"


def test_values_not_shaped_like_hub_ids_are_left_to_their_loader(hub_cache):
    for value in ["/no/such/dir", "./ckpt/x", "../up/x", "~/x/y", "a/b/c", "plain", "bad//id"]:
        assert not looks_like_hub_id(value), value
        assert resolve_model_path("model.hf_checkpoint", value) == value
    assert looks_like_hub_id("Qwen/Qwen3-30B-A3B") and looks_like_hub_id("zai-org/GLM-4.5-Air")


def test_a_config_without_model_paths_is_unchanged(hub_cache):
    cfg = compose([])
    assert resolve_model_paths(cfg) is cfg


def test_a_hub_id_not_in_the_cache_with_the_hub_unreachable_is_refused_with_the_fix(hub_cache, monkeypatch):
    """Online mode, but the hub is a loopback port that refuses connections (bound, never listening)."""
    import socket

    with socket.socket() as refusing:
        refusing.bind(("127.0.0.1", 0))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{refusing.getsockname()[1]}")
        with pytest.raises(HubCheckpointError) as refused:
            resolve_model_path("tokenizer.path", "Qwen/Qwen3-30B-A3B")
    message = str(refused.value)
    print(message)
    assert message.startswith("tokenizer.path=Qwen/Qwen3-30B-A3B is not a local directory")
    assert str(hub_cache) in message and "hf download Qwen/Qwen3-30B-A3B" in message
    assert "ConnectError" in message and not list(hub_cache.rglob("blobs/*"))  # the cause named; nothing fetched
