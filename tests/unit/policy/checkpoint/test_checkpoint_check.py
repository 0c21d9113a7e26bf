"""Damaged, older and foreign checkpoints are refused when the run directory is claimed (before
anything is built), each naming the file and what is wrong (issue 34, D11 and D14)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from gspo_megatron.config.schema import CheckpointSection
from gspo_megatron.core.run_dir import RunDirError
from gspo_megatron.run.run_dir_owner import LOCK_FILE, claim_run_dir

CONFIG = "optimizer:\n  lr: 0.001\n"


def _state(**changes) -> dict:
    state = {
        "step": 1,
        "scheduler": {"max_lr": 0.001, "num_steps": 2},
        "task": {"task": "max_digit", "seed": 0, "index": 4},
        "config": CONFIG,
        "clip_controller": None,
        "rollout_scheduler": {"pending": None},
        "rng_per_rank": [{"torch": torch.get_rng_state()}],
        "run_id": "a" * 32,
    }
    state.update(changes)
    return {k: v for k, v in state.items() if v is not _DROP}


_DROP = object()


# megatron's metadata.json, as each megatron-core writes it: 0.16 keeps the common state in common.pt
CONFIG_017 = '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'  # 0.17+: common state inside DCP
CONFIG_016 = CONFIG_017[:-1] + ', "common_backend": "torch", "common_backend_version": 1}'


def _checkpoint(run_dir: Path, state: dict | None = None, config: str = CONFIG_016) -> Path:
    """A checkpoint's files as save_checkpoint lays them out (megatron's shards are not read by the claim)."""
    path = run_dir / "checkpoints" / "step_000001"
    (path / "model_optim").mkdir(parents=True)
    names = (".metadata", "__0_0.distcp") + (("common.pt",) if "common_backend" in config else ())
    for name in names:
        (path / "model_optim" / name).write_bytes(b"megatron's")
    (path / "model_optim" / "metadata.json").write_text(config)
    torch.save(_state() if state is None else state, path / "trainer_state.pt")
    (path / "run_id").write_text("a" * 32)
    (run_dir / "checkpoints" / "latest").write_text(path.name)
    return path


def _refusal(run_dir: Path, **section) -> str:
    with pytest.raises(RunDirError) as info:  # a CheckpointError is one
        claim_run_dir(run_dir, CheckpointSection(resume="true", **section), CONFIG)
    assert not (run_dir / LOCK_FILE).exists()
    return str(info.value)


def test_an_intact_checkpoint_is_claimed_for_resume(tmp_path):
    path = _checkpoint(tmp_path)
    claim = claim_run_dir(tmp_path, CheckpointSection(resume="true"), CONFIG)
    assert claim.resume_from == path
    claim.release()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: f.write_bytes(b""), r"trainer_state.pt cannot be read \(EOFError\): it is truncated or damaged"),
        (lambda f: f.write_bytes(f.read_bytes()[:200]), r"trainer_state.pt cannot be read \(.*\): it is truncated"),
        (lambda f: torch.save(_state(scheduler=_DROP), f), r"trainer_state.pt has no 'scheduler': .*older version"),
        (lambda f: torch.save(_state(step="three"), f), r"trainer_state.pt: 'step' is 'three', not a valid step"),
        (lambda f: torch.save(_state(step=-1), f), r"'step' is -1, not a valid step"),
        (lambda f: torch.save([1, 2], f), r"trainer_state.pt holds a list, not a trainer state"),
    ],
    ids=["empty", "truncated", "older_no_scheduler", "step_text", "step_negative", "not_a_dict"],
)
def test_damaged_trainer_state_is_named(tmp_path, damage, message):
    damage(_checkpoint(tmp_path) / "trainer_state.pt")
    refusal = _refusal(tmp_path)
    assert str(tmp_path / "checkpoints" / "step_000001" / "trainer_state.pt") in refusal
    assert re.search(message, refusal), refusal
    assert "resume from an earlier checkpoint" in refusal


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_state_file_carrying_code_is_refused_without_advising_weights_only_false(tmp_path):
    marker = tmp_path / "ran"
    path = _checkpoint(tmp_path, _state(task=_RunsCode(str(marker))))
    refusal = _refusal(tmp_path)
    assert f"{path / 'trainer_state.pt'} holds objects other than plain data" in refusal
    assert "GLOBAL posix.system" in refusal and "weights_only" not in refusal
    assert not marker.exists()


@pytest.mark.parametrize(
    "config, name",
    [
        (CONFIG_016, "common.pt"),
        (CONFIG_016, ".metadata"),
        (CONFIG_016, "metadata.json"),
        (CONFIG_017, ".metadata"),
        (CONFIG_017, "metadata.json"),
    ],
    ids=["0.16_common", "0.16_metadata", "0.16_config", "0.17_metadata", "0.17_config"],
)
def test_missing_model_files_are_named(tmp_path, config, name):
    """megatron reported a missing common.pt as "'str' object has no attribute 'iterdir'"; which files a
    checkpoint needs depends on the megatron-core that wrote it (its metadata.json says)."""
    path = _checkpoint(tmp_path, config=config)
    (path / "model_optim" / name).unlink()
    refusal = _refusal(tmp_path)
    assert f"{path / 'model_optim' / name} is missing: checkpoint {path} is incomplete" in refusal


def test_a_checkpoint_of_megatron_017_needs_no_common_pt(tmp_path):
    path = _checkpoint(tmp_path, config=CONFIG_017)
    assert not (path / "model_optim" / "common.pt").exists()
    claim = claim_run_dir(tmp_path, CheckpointSection(resume="true"), CONFIG)
    assert claim.resume_from == path
    claim.release()


@pytest.mark.parametrize(
    "config", ["not json", '{"sharded_backend": "zarr"}', "[1, 2]", " " * 70000], ids=["text", "zarr", "list", "huge"]
)
def test_a_foreign_checkpoint_description_is_named(tmp_path, config):
    path = _checkpoint(tmp_path, config=config)
    refusal = _refusal(tmp_path)
    assert f"checkpoint {path} is damaged: {path / 'model_optim' / 'metadata.json'} does not describe a torch_dist" in (
        refusal
    )


def test_checkpoint_without_its_config_is_resumed_only_when_allowed(tmp_path):
    """D11: without the saved config nothing can be compared; that used to pass silently."""
    path = _checkpoint(tmp_path, _state(config=_DROP))
    refusal = _refusal(tmp_path)
    assert f"refusing to resume {path}: its trainer state holds no config" in refusal
    assert "checkpoint.allow_resume_without_config=true" in refusal
    claim = claim_run_dir(tmp_path, CheckpointSection(resume="true", allow_resume_without_config=True), CONFIG)
    assert claim.resume_from == path
    claim.release()


@pytest.mark.parametrize(
    "pointer, message",
    [
        ("", "is empty (a write was cut short)"),
        ("   \n", "is empty (a write was cut short)"),
        ("../../other_run/checkpoints/step_000001", "names '../../other_run/checkpoints/step_000001', which is not"),
        ("/tmp/other_run/checkpoints/step_000001", "which is not a checkpoint of"),
        ("step_000009", "names step_000009, which is not a complete checkpoint"),
    ],
    ids=["empty", "blank", "relative_elsewhere", "absolute_elsewhere", "missing"],
)
def test_latest_names_only_a_complete_checkpoint_of_this_run(tmp_path, pointer, message):
    """issue 43: an empty ``latest`` was reported as naming 'checkpoints'; one naming another run's
    directory was followed and trained on."""
    other = tmp_path / "other_run"
    _checkpoint(other)  # a complete checkpoint elsewhere: never to be followed
    run_dir = tmp_path / "run"
    _checkpoint(run_dir)
    (run_dir / "checkpoints" / "latest").write_text(pointer)
    refusal = _refusal(run_dir)
    assert f"{run_dir / 'checkpoints' / 'latest'} " in refusal and message in refusal, refusal
    assert "write the name of a complete checkpoint of this run" in refusal
