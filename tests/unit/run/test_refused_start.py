"""A refused start-up: which errors are refusals, and which directories the failed start removes."""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_megatron.config.validate import ConfigError
from gspo_megatron.core.run_dir import RunDirError
from gspo_megatron.run.refused_start import REFUSALS, STARTUP_RECORD, is_refusal, remove_startup_record


def test_the_project_refusals_are_refusals_and_other_errors_are_not():
    assert is_refusal(ConfigError("trainer.steps must be > 0"))
    assert is_refusal(RunDirError("refusing ..."))
    assert not is_refusal(ValueError("a bug"))
    assert not is_refusal(KeyError("x"))


@pytest.mark.parametrize(("module", "name"), REFUSALS)
def test_every_listed_refusal_exists(module, name):
    import importlib

    assert issubclass(getattr(importlib.import_module(module), name), Exception)


def _record(run_dir: Path) -> None:
    for name in STARTUP_RECORD:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text("x")


def test_a_directory_the_run_made_holding_only_the_record_goes(tmp_path):
    made = [tmp_path / "a" / "run", tmp_path / "a"]
    made[0].mkdir(parents=True)
    _record(made[0])
    assert remove_startup_record(made[0], made)
    assert not (tmp_path / "a").exists()


def test_a_directory_holding_anything_else_stays_whole(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _record(run_dir)
    (run_dir / "notes.txt").write_text("mine")
    assert not remove_startup_record(run_dir, [run_dir])
    assert {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()} == {*STARTUP_RECORD, "notes.txt"}


def test_a_directory_the_run_did_not_make_stays(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _record(run_dir)
    assert not remove_startup_record(run_dir, [])
    assert (run_dir / ".hydra" / "config.yaml").is_file()
