"""Which megatron-core wrote a checkpoint, what files it needs, and the error that names a version
difference when a load fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_megatron.policy.checkpoint import formats as checkpoint_format
from gspo_megatron.policy.checkpoint.formats import (
    WRITTEN_BY_KEY,
    CheckpointFormatError,
    common_state_in_file,
    installed_versions,
    model_files,
    written_by,
)
from gspo_megatron.policy.checkpoint.store import MODEL_DIR, CheckpointVersionError

CONFIG_017 = '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
CONFIG_016 = CONFIG_017[:-1] + ', "common_backend": "torch", "common_backend_version": 1}'


def _model_dir(tmp_path: Path, config: str | None) -> Path:
    model_dir = tmp_path / "step_000002" / MODEL_DIR
    model_dir.mkdir(parents=True)
    if config is not None:
        (model_dir / "metadata.json").write_text(config)
    return model_dir


def test_the_format_follows_metadata_json(tmp_path):
    old, new = _model_dir(tmp_path / "a", CONFIG_016), _model_dir(tmp_path / "b", CONFIG_017)
    assert common_state_in_file(old) and not common_state_in_file(new)
    assert model_files(old) == ("metadata.json", ".metadata", "common.pt")
    assert model_files(new) == ("metadata.json", ".metadata")


def test_a_missing_description_is_named(tmp_path):
    model_dir = _model_dir(tmp_path, None)
    with pytest.raises(CheckpointFormatError, match=f"{model_dir / 'metadata.json'} is missing"):
        common_state_in_file(model_dir)


def test_the_writer_is_recorded_or_inferred_from_the_format(tmp_path):
    recorded = {"megatron-core": "0.19.2", "torch": "2.15.0"}
    assert written_by({WRITTEN_BY_KEY: recorded}, _model_dir(tmp_path / "a", CONFIG_016)) == recorded
    assert written_by({}, _model_dir(tmp_path / "b", CONFIG_016)) == {"megatron-core": "<= 0.16"}
    assert written_by({}, _model_dir(tmp_path / "c", CONFIG_017)) == {"megatron-core": ">= 0.17"}
    assert written_by({WRITTEN_BY_KEY: "0.19"}, _model_dir(tmp_path / "d", None)) == {"megatron-core": "unknown"}


def test_installed_versions_name_the_release_not_the_build(monkeypatch):
    releases = {"megatron-core": "0.16.1", "torch": "2.13.0+cpu"}
    monkeypatch.setattr(checkpoint_format, "version", releases.__getitem__)
    assert installed_versions() == {"megatron-core": "0.16.1", "torch": "2.13.0"}


def test_a_failed_load_names_the_versions_that_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_format, "version", {"megatron-core": "0.16.1", "torch": "2.13.0+cpu"}.__getitem__)
    path = _model_dir(tmp_path, CONFIG_017).parent
    state = {WRITTEN_BY_KEY: {"megatron-core": "0.19.2", "torch": "2.15.0"}}
    message = str(CheckpointVersionError(path, state, ValueError("too many values to unpack (expected 5)")))
    assert f"checkpoint {path} could not be loaded (ValueError: too many values to unpack (expected 5))" in message
    assert "megatron-core 0.19.2 wrote it, 0.16.1 reads it; torch 2.15.0 wrote it, 2.13.0 reads it" in message
    same = str(
        CheckpointVersionError(path, {WRITTEN_BY_KEY: {"megatron-core": "0.16.1", "torch": "2.13.0"}}, KeyError())
    )
    assert "the same versions wrote it: the checkpoint is damaged" in same
