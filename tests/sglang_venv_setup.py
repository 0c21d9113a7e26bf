"""The SGLang tiers' wait for their venv while the set-up is still making it in the background (issue 65).

``launch/setup_tests.sh`` (the README's test command) starts ``launch/setup_sglang_background.sh`` where
``.venv-sglang`` is missing or out of date: ``launch/setup_sglang.sh`` runs niced in the background while
pytest runs the other tiers, and writes to fixed, git-ignored files in ``.sglang-setup/`` (``SETUP_DIR``):
``started`` before the job starts, ``log`` as it runs, ``status`` (its exit status) when it ends. The contract
and live tiers call ``wait_for_sglang_setup()`` before they touch the venv:

- no ``started``: nothing waits (the venv was current, or made before pytest by ``launch/setup_sglang.sh``);
- ``started``, no ``status``: wait, bounded by ``SETUP_WAIT_S``, and fail at once if the job (``pid``) has
  ended without writing one;
- ``status`` 0: go; any other: fail with the status and the log's tail.

Design decisions:
- The tiers wait for the status file, never for the venv's own files: a venv half made by a running pip
  already has ``bin/python``. The status is written to a temporary name and moved (one rename), so a
  file that exists holds the whole status; the set-up removes an earlier set-up's files before it starts,
  so a status that exists is this set-up's.
- Fixed paths in the checkout, not an environment variable: the README's command sets up and tests in two
  processes, and ``python3 -m pytest`` alone after it must still wait.
- The wait is bounded (``SETUP_WAIT_S``, below pytest's 900 s per-test limit, so the failure names the set-up
  instead of a timeout's traceback) and a failed set-up fails the tier with the tail of its log: neither
  tier can pass or skip by itself while the venv is missing.
- ``tests/conftest.py`` orders both tiers after the distributed and e2e tiers (several minutes of work on
  two workers), so the set-up has normally ended when they start and no worker waits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

SETUP_DIR = Path(__file__).resolve().parents[1] / ".sglang-setup"
SETUP_WAIT_S = 840.0
POLL_S = 1.0
LOG_TAIL_CHARS = 4000
WHAT = "the SGLang venv's set-up (launch/setup_sglang.sh, in the background: launch/setup_sglang_background.sh)"


def background_setup_started(state: Path = SETUP_DIR) -> bool:
    """Whether the set-up started making the venv in the background (it may have ended since)."""
    return (state / "started").exists()


def wait_for_sglang_setup(timeout_s: float = SETUP_WAIT_S, state: Path = SETUP_DIR) -> None:
    """Return once the background set-up of ``.venv-sglang`` has succeeded; fail the test if it failed, ended
    without a status, or has not ended within ``timeout_s``. Returns at once where none was started."""
    if not background_setup_started(state):
        return
    status = state / "status"
    deadline = time.monotonic() + timeout_s
    while not status.exists():
        if not _job_running(state) and not status.exists():  # the status is written before the job ends
            _fail(state, f"ended without writing its exit status to {status}")
        if time.monotonic() >= deadline:
            _fail(state, f"had not ended after {timeout_s:.0f} s (no exit status in {status})")
        time.sleep(POLL_S)
    code = status.read_text().strip()
    if code != "0":
        _fail(
            state,
            f"failed with exit status {code or '(empty)'}; run `bash launch/setup_sglang.sh` to see it fail, or to "
            "make the venv after a fix (a run that succeeds clears this status)",
        )


def _job_running(state: Path) -> bool:
    """Whether the job's process group still has a process; True while its pid is not yet written (the
    set-up writes it right after starting the job)."""
    try:
        pid = int((state / "pid").read_text())
    except (FileNotFoundError, ValueError):
        return True
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process group of another user's: alive
        return True
    return True


def _fail(state: Path, what_happened: str) -> None:
    log = state / "log"
    tail = log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log.is_file() else "(no log written)"
    pytest.fail(f"{WHAT} {what_happened}; its output, {log}:\n{tail}", pytrace=False)
