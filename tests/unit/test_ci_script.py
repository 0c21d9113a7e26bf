"""CI's entry point runs the README's test command and fails loudly: a broken set-up must not pass CI by
running nothing.

``.ci/run`` is run in scratch copies of the repository whose set-up scripts are stand-ins and whose second
leg only leaves a mark."""

from __future__ import annotations

import os
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


def test_ci_runs_the_readmes_test_command_verbatim():
    """One README command sets up and passes the tests on a fresh machine, and CI's main leg is that command."""
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line for line in readme if line.startswith("bash launch/setup_tests.sh && ")]
    assert len(commands) == 1, f"README.md shows no single test command: {commands}"
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(line == commands[0] or line.startswith(commands[0] + " || ") for line in ci_lines), (
        f".ci/run does not run README.md's test command `{commands[0]}` as it stands"
    )


SCRATCH_TEST = """from pathlib import Path

from sglang_venv_setup import wait_for_sglang_setup


def test_the_sglang_tier_waits_for_the_background_set_up():
    Path({started!r}).touch()  # the set-up below waits for this: it runs while pytest does
    wait_for_sglang_setup()
"""
# the SGLang venv's set-up: never current (--check); ends with `code` once the scratch test has started, exit 9
# if it never does
SCRATCH_SGLANG_SETUP = """[ "${{1:-}}" = --check ] && exit 1
for _ in $(seq 1200); do [ -e {started!r} ] && exit {code}; sleep 0.1; done
exit 9
"""


@pytest.mark.parametrize("code", [0, 5])
def test_the_sglang_venv_is_made_while_the_tests_run_and_its_failure_fails_ci(tmp_path, code):
    """The README's command makes the SGLang venv in the background while pytest runs (issue 65;
    launch/setup_sglang_background.sh, the real one): the scratch set-up can only end once the scratch test has
    started, and that test waits for its exit status (tests/sglang_venv_setup.py, the real one): a set-up run
    before pytest, or a test that did not wait, fails here. A set-up that fails fails CI with its status, and no
    later leg runs."""
    started = tmp_path / "the_test_started"
    for folder in (".ci", "launch", "tests"):
        (tmp_path / folder).mkdir()
    for name in ("run", "timing_summary.py"):
        shutil.copy2(ROOT / ".ci" / name, tmp_path / ".ci" / name)
    shutil.copy2(ROOT / "launch" / "setup_sglang_background.sh", tmp_path / "launch")
    shutil.copy2(ROOT / "tests" / "sglang_venv_setup.py", tmp_path / "tests")
    (tmp_path / "tests" / "test_scratch.py").write_text(SCRATCH_TEST.format(started=str(started)))
    # launch/setup_tests.sh's last step, without its installs
    (tmp_path / "launch" / "setup_tests.sh").write_text("bash launch/setup_sglang_background.sh\n")
    (tmp_path / "launch" / "setup_sglang.sh").write_text(SCRATCH_SGLANG_SETUP.format(started=str(started), code=code))
    (tmp_path / ".ci" / "newest_stack").write_text(f"touch {tmp_path / 'second_leg_ran'}\n")
    # not this session's pytest or xdist settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "GSPO_SKIP_SGLANG"}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=300, env=env)
    output = done.stdout + done.stderr
    assert f"[setup] SGLang venv, made in the background: exit {code} in" in done.stdout, output
    if code == 0:
        assert done.returncode == 0, output
        assert (tmp_path / "second_leg_ran").exists()
    else:
        assert done.returncode != 0 and "main leg failed" in done.stderr, output
        assert f"failed with exit status {code}" in output, output
        assert not (tmp_path / "second_leg_ran").exists()
