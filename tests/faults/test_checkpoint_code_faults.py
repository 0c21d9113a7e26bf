"""A crafted checkpoint runs no code on resume (issue 34, D1).

One real 1-step run writes a checkpoint; each test copies it, plants a pickle whose unpickling would
write a marker file (a ``.metadata`` of its own, or an ``_extra_state`` item the genuine metadata
points at), and resumes a real training process from it: the marker never appears and the error
names the file.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gspo_megatron.policy.checkpoint.reader import read_metadata_safely
from gspo_megatron.policy.checkpoint.store import MODEL_DIR, latest_checkpoint
from gspo_megatron.testing.train_runs import FAST, run_training

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

BASE = FAST + ["trainer.steps=1", "checkpoint.save_every=1", "routing.enabled=false"]


class _WritesMarker:
    """Unpickling this calls ``exec``: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write(str(__import__('os').getpid()))",))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    done = run_training(BASE, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _copy(saved_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    return run_dir, latest_checkpoint(run_dir) / MODEL_DIR


def _resume(run_dir: Path):
    return run_training(
        BASE + ["checkpoint.resume=true", "trainer.steps=2", "checkpoint.resume_allow_changes=[trainer.steps]"], run_dir
    )


def test_genuine_metadata_reads_the_same_as_pickle(saved_run):
    metadata_file = latest_checkpoint(saved_run) / MODEL_DIR / ".metadata"
    safe = read_metadata_safely(metadata_file)
    plain = pickle.loads(metadata_file.read_bytes())  # our own file, written just now
    assert safe.state_dict_metadata == plain.state_dict_metadata
    assert safe.storage_data == plain.storage_data


def test_crafted_metadata_runs_no_code(saved_run, tmp_path):
    run_dir, model_dir = _copy(saved_run, tmp_path)
    marker = tmp_path / "metadata_ran"
    (model_dir / ".metadata").write_bytes(pickle.dumps(_WritesMarker(marker), protocol=4))
    done = _resume(run_dir)
    assert not marker.exists(), f"the crafted .metadata ran code in pid {marker.read_text()}"
    assert done.returncode != 0
    assert f"{model_dir / '.metadata'}: refusing to load: it references builtins.exec" in done.stderr, done.stderr[
        -3000:
    ]


def test_crafted_extra_state_runs_no_code(saved_run, tmp_path):
    """Point one ``_extra_state`` item of the (genuine, allow-listed) metadata at a crafted pickle."""
    run_dir, model_dir = _copy(saved_run, tmp_path)
    marker = tmp_path / "extra_state_ran"
    payload = io.BytesIO()
    torch.save(_WritesMarker(marker), payload)
    (model_dir / "__9_0.distcp").write_bytes(payload.getvalue())
    metadata = pickle.loads((model_dir / ".metadata").read_bytes())
    target = next(index for index in metadata.storage_data if "_extra_state" in index.fqn)
    stored = metadata.storage_data[target]
    metadata.storage_data[target] = replace(
        stored, relative_path="__9_0.distcp", offset=0, length=len(payload.getvalue())
    )
    (model_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    done = _resume(run_dir)
    assert not marker.exists(), f"the crafted _extra_state ran code in pid {marker.read_text()}"
    assert done.returncode != 0
    assert f"{model_dir / '__9_0.distcp'}: item {target.fqn} is not plain data" in done.stderr, done.stderr[-3000:]
    assert os.path.getsize(model_dir / "__9_0.distcp") == len(payload.getvalue())  # nothing rewrote it
