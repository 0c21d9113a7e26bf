"""CI's entry point fails loudly: a broken set-up must not pass CI by running nothing.

``.ci/run`` is run in a scratch copy of the repository whose set-up script fails and whose second leg
only leaves a mark."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from sglang_venv_setup import STATUS_ENV

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


SCRATCH_TEST = """from pathlib import Path

from sglang_venv_setup import wait_for_sglang_setup


def test_the_sglang_tier_waits_for_the_background_set_up():
    Path({started!r}).touch()  # the set-up below waits for this: it runs while pytest does
    wait_for_sglang_setup()
"""
# the SGLang venv's set-up: ends with `code` once the scratch test has started, exit 9 if it never does
SCRATCH_SGLANG_SETUP = """for _ in $(seq 1200); do [ -e {started!r} ] && exit {code}; sleep 0.1; done
exit 9
"""


@pytest.mark.parametrize("code", [0, 5])
def test_the_sglang_venv_is_made_while_the_tests_run_and_its_failure_fails_ci(tmp_path, code):
    """.ci/run makes the SGLang venv in the background while pytest runs (issue 65): the scratch set-up can
    only end once the scratch test has started, and that test waits for its exit status
    (tests/sglang_venv_setup.py): a set-up run before pytest, or a test that did not wait, fails here. A set-up
    that fails fails CI with its status, and no later leg runs."""
    started = tmp_path / "the_test_started"
    (tmp_path / ".ci").mkdir()
    (tmp_path / "launch").mkdir()
    (tmp_path / "tests").mkdir()
    for name in ("run", "timing_summary.py"):
        shutil.copy2(ROOT / ".ci" / name, tmp_path / ".ci" / name)
    shutil.copy2(ROOT / "tests" / "sglang_venv_setup.py", tmp_path / "tests" / "sglang_venv_setup.py")
    (tmp_path / "tests" / "test_scratch.py").write_text(SCRATCH_TEST.format(started=str(started)))
    (tmp_path / "launch" / "setup_tests.sh").write_text("exit 0\n")
    (tmp_path / "launch" / "setup_sglang.sh").write_text(SCRATCH_SGLANG_SETUP.format(started=str(started), code=code))
    (tmp_path / ".ci" / "newest_stack").write_text(f"touch {tmp_path / 'second_leg_ran'}\n")
    # not this session's pytest or xdist settings, nor its own background set-up's status
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != STATUS_ENV}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=300, env=env)
    output = done.stdout + done.stderr
    assert f"[ci] SGLang venv set-up, in the background: exit {code} in" in output, output
    if code == 0:
        assert done.returncode == 0, output
        assert (tmp_path / "second_leg_ran").exists()
    else:
        assert done.returncode != 0 and "main leg failed" in done.stderr, output
        assert f"failed with exit status {code}" in output, output
        assert not (tmp_path / "second_leg_ran").exists()
