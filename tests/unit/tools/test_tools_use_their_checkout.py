"""A study tool runs (and records the provenance of) the package of the checkout it lives in, not
whichever ``gspo_megatron`` is installed: a tool run from a second checkout (a git worktree, a study
at an older commit) once evaluated and recorded the installed checkout's code and commit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
STUDY_TOOLS = [
    "shaping_study.py",
    "sft_warmstart.py",
    "calibrate_confidence_segmentation.py",
    "compare_runs.py",
    "store_runs.py",
    "regenerate_report.py",
    "async_report.py",
]


@pytest.mark.slow
@pytest.mark.parametrize("tool", STUDY_TOOLS)
def test_a_study_tool_imports_its_own_checkouts_package(tool, tmp_path):
    decoy = tmp_path / "installed" / "gspo_megatron"  # stands for another checkout's package, found first
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("")
    script = (
        f"import runpy, sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); "
        f"runpy.run_path({str(ROOT / 'tools' / tool)!r}, run_name='imported'); "
        "import gspo_megatron; print(gspo_megatron.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(decoy.parent)}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip().splitlines()[-1]) == ROOT / "gspo_megatron" / "__init__.py"
