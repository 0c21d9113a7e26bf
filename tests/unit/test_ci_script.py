"""CI's entry point fails loudly: a broken set-up must not pass CI by running nothing.

``.ci/run`` is run in a scratch copy of the repository whose set-up script fails and whose second leg
only leaves a mark."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # starts bash processes


def test_a_failing_setup_fails_ci_and_runs_no_later_leg(tmp_path):
    """Was: ``setup && pytest`` under ``set -e`` let a failing set-up pass by (bash does not stop on a
    failed command before ``&&``), and with the second leg green CI ended with status 0 and no test run."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / "launch").mkdir()
    shutil.copy2(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "launch" / "setup_tests.sh").write_text("exit 3\n")
    (tmp_path / ".ci" / "newest_stack").write_text(f"touch {tmp_path / 'second_leg_ran'}\n")
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout + done.stderr
    assert not (tmp_path / "second_leg_ran").exists()
    assert "main leg failed" in done.stderr
