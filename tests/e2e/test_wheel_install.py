"""The wheel works: built from this checkout, installed into a fresh venv (no system site-packages, so
no editable install or repository path can help), ``gspo-train trainer.steps=2`` trains from an
empty directory.

Design decisions:
- pip's own configuration says where torch and the dependencies come from (the CPU build of
  ``torch==2.13.0`` first, as ``launch/install_torch.sh`` does, so pip never resolves a CUDA build);
  the test names no package index. The pip cache makes a second run mostly local.
- pip installs with ``--no-compile``: writing bytecode for every module of torch and the dependencies
  took half of the torch install (37 s against 17 s on 2 cores); the run compiles what it imports.
- The wheel is built without build isolation (the interpreter's setuptools), so building needs no
  download, from a copy of the package's files (setuptools writes ``build/`` into the source tree).
- ``PYTHONPATH`` is dropped from the environment of everything that runs in the venv: the run must
  import the installed package, which the test checks from inside the venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gspo_megatron.testing.train_runs import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, (
        f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    )
    return result


def _source_copy(target: Path) -> Path:
    """What the wheel is built from, copied: setuptools builds in the source tree, and a ``build/``
    left there from an earlier tree would put deleted modules into the wheel."""
    target.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, target / name)
    shutil.copytree(ROOT / "gspo_megatron", target / "gspo_megatron", ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_the_wheel_trains_from_an_empty_directory(tmp_path):
    dist, source = tmp_path / "dist", _source_copy(tmp_path / "source")
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)],
        tmp_path,
    )
    (wheel,) = dist.glob("gspo_megatron-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gspo_megatron/conf/config.yaml" in names and "gspo_megatron/conf/model/tiny.yaml" in names
    assert not [n for n in names if n.startswith("gspo_megatron/testing/")], "test doubles are not shipped"
    assert not [n for n in names if "study_report" in n or n.startswith("tools/")], "study reports are not shipped"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-compile", TORCH], tmp_path)
    _run([str(python), "-m", "pip", "install", "-q", "--no-compile", str(wheel)], tmp_path)
    where = _run([str(python), "-c", "import gspo_megatron; print(gspo_megatron.__file__)"], tmp_path).stdout
    assert Path(where.strip()).is_relative_to(venv), f"the venv imported {where.strip()}, not its installed wheel"

    empty = tmp_path / "empty"
    empty.mkdir()
    _run([str(venv / "bin" / "gspo-train"), "trainer.steps=2"], empty)
    (run_dir,) = (empty / "runs").iterdir()  # Hydra's run directory, under the working directory
    steps = sorted({row["step"] for row in read_metrics(run_dir)})
    assert steps == [1, 2], f"expected steps 1 and 2 in {run_dir}/metrics.jsonl, got {steps}"
