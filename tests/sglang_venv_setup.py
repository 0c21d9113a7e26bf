"""The SGLang tiers' wait for their venv while CI's set-up is still making it (issue 65).

CI's main leg (``.ci/run``) makes ``.venv-sglang`` (``launch/setup_sglang.sh``, about 150 s of a fresh
clone's set-up) in the background while pytest runs the other tiers, and names in ``GSPO_SGLANG_SETUP_STATUS``
the file that the set-up's exit status is moved to once it ends; its output is ``<that file>.log``. The
contract and live tiers call ``wait_for_sglang_setup()`` before they touch the venv.

Design decisions:
- The tiers wait for the status file, never for the venv's own files: a venv half made by a running pip
  already has ``bin/python``. The status is written to a temporary name and moved (one rename), so a
  file that exists holds the whole status.
- The wait is bounded (``SETUP_WAIT_S``, below pytest's 900 s per-test limit, so the failure names the set-up
  instead of a timeout's traceback) and a failed set-up fails the tier with the tail of its log: neither
  tier can pass or skip by itself while the venv is missing.
- ``tests/conftest.py`` orders both tiers after the distributed and e2e tiers (several minutes of work on
  two workers), so the set-up has normally ended when they start and no worker waits.
- Without the variable (a plain ``launch/setup_tests.sh && python3 -m pytest``) nothing waits: the venv
  was made before pytest started.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

STATUS_ENV = "GSPO_SGLANG_SETUP_STATUS"
SETUP_WAIT_S = 840.0
POLL_S = 1.0
LOG_TAIL_CHARS = 4000


def background_setup_status() -> Path | None:
    """The status file a background set-up will write, or None when the venv was made before pytest."""
    value = os.environ.get(STATUS_ENV, "")
    return Path(value) if value else None


def setup_log(status: Path) -> Path:
    return status.with_name(status.name + ".log")


def wait_for_sglang_setup(timeout_s: float = SETUP_WAIT_S) -> None:
    """Return once the background set-up of ``.venv-sglang`` has succeeded; fail the test if it failed or
    has not ended within ``timeout_s``. Returns at once where no background set-up was started."""
    status = background_setup_status()
    if status is None:
        return
    deadline = time.monotonic() + timeout_s
    while not status.exists():
        if time.monotonic() >= deadline:
            pytest.fail(
                f"the SGLang venv's set-up (launch/setup_sglang.sh, run in the background by .ci/run) had not "
                f"ended after {timeout_s:.0f} s: no exit status in {status} ({STATUS_ENV}); its output so far, "
                f"{setup_log(status)}:\n{_tail(setup_log(status))}",
                pytrace=False,
            )
        time.sleep(POLL_S)
    code = status.read_text().strip()
    if code != "0":
        pytest.fail(
            f"the SGLang venv's set-up (launch/setup_sglang.sh, run in the background by .ci/run) failed with "
            f"exit status {code or '(empty)'}; rerun it by hand to see it fail; its output, "
            f"{setup_log(status)}:\n{_tail(setup_log(status))}",
            pytrace=False,
        )


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log.is_file() else "(no log written)"
