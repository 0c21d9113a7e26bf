"""The background set-up of the SGLang venv (launch/setup_sglang_background.sh) and the SGLang tiers' wait for it
(tests/sglang_venv_setup.py); .ci/run's side is tests/unit/test_ci_script.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from sglang_venv_setup import background_setup_started, wait_for_sglang_setup

ROOT = Path(__file__).resolve().parents[2]


def _state(tmp_path: Path, pid: int | None = None) -> Path:
    """A background set-up's files as launch/setup_sglang_background.sh writes them at its start."""
    state = tmp_path / ".sglang-setup"
    state.mkdir()
    (state / "started").touch()
    if pid is not None:
        (state / "pid").write_text(f"{pid}\n")
    return state


def test_without_a_background_set_up_nothing_waits(tmp_path):
    wait_for_sglang_setup(timeout_s=0, state=tmp_path / ".sglang-setup")


def test_a_status_written_while_waiting_ends_the_wait(tmp_path):
    state = _state(tmp_path, pid=os.getpgrp())  # a process group that runs: this test's

    def write_status() -> None:  # as launch/setup_sglang_background.sh does: a temporary name, then moved, so a
        (state / "status.tmp").write_text("0\n")  # status that exists is whole (a plain write_text raced the
        os.replace(state / "status.tmp", state / "status")  # wait: it once read the file empty, newest leg)

    writer = threading.Thread(target=write_status)
    writer.start()
    try:
        wait_for_sglang_setup(timeout_s=60, state=state)
    finally:
        writer.join(timeout=60)


def test_a_failed_set_up_fails_the_tier_with_its_status_and_its_log(tmp_path):
    state = _state(tmp_path)
    (state / "log").write_text("ERROR: No matching distribution found for sglang==0.5.23\n")
    (state / "status").write_text("2\n")
    with pytest.raises(pytest.fail.Exception) as failure:
        wait_for_sglang_setup(timeout_s=60, state=state)
    assert "exit status 2" in str(failure.value) and "No matching distribution" in str(failure.value)


def test_a_set_up_that_has_not_ended_fails_the_tier_after_the_bound(tmp_path):
    state = _state(tmp_path, pid=os.getpgrp())
    (state / "log").write_text("Collecting sglang==0.5.23\n")
    with pytest.raises(pytest.fail.Exception) as failure:
        wait_for_sglang_setup(timeout_s=0, state=state)
    assert "had not ended after 0 s" in str(failure.value) and "Collecting sglang" in str(failure.value)


def test_a_set_up_that_ended_without_a_status_fails_the_tier_at_once(tmp_path):
    ended = subprocess.Popen(["true"], start_new_session=True)  # its own process group, gone once reaped
    ended.wait(timeout=60)
    state = _state(tmp_path, pid=ended.pid)
    with pytest.raises(pytest.fail.Exception) as failure:
        wait_for_sglang_setup(timeout_s=600, state=state)
    assert "ended without writing its exit status" in str(failure.value)


# the SGLang venv's set-up: current (--check) once `current` exists; a run ends with the code in `go`
FAKE_SGLANG_SETUP = """[ "${{1:-}}" = --check ] && {{ [ -e {current!r} ]; exit; }}
echo "installing"
for _ in $(seq 600); do [ -e {go!r} ] && exit "$(cat {go!r})"; sleep 0.1; done
exit 9
"""


@pytest.mark.slow  # starts bash processes
def test_the_background_set_up_starts_the_job_returns_and_is_waited_for(tmp_path):
    """launch/setup_sglang_background.sh, the real one, with a stand-in for launch/setup_sglang.sh: it returns
    while the job runs (its output pipe closed: the job does not hold it), leaves a running job alone when run
    again, and the wait ends with the job; a later run with the venv current clears the finished set-up's files,
    so its status is not read as the next one's."""
    (tmp_path / "launch").mkdir()
    shutil.copy2(ROOT / "launch" / "setup_sglang_background.sh", tmp_path / "launch")
    current, go = tmp_path / "venv_current", tmp_path / "go"
    (tmp_path / "launch" / "setup_sglang.sh").write_text(FAKE_SGLANG_SETUP.format(current=str(current), go=str(go)))
    env = {k: v for k, v in os.environ.items() if k != "GSPO_SKIP_SGLANG"}

    def set_up() -> str:
        script = tmp_path / "launch" / "setup_sglang_background.sh"
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    state = tmp_path / ".sglang-setup"
    try:
        assert "making the SGLang venv in the background" in set_up()
        assert background_setup_started(state) and not (state / "status").exists()
        assert "still running" in set_up() and background_setup_started(state)
        go.write_text("0")
        wait_for_sglang_setup(timeout_s=120, state=state)
    finally:
        go.write_text("0")  # the job ends within a second whatever happened above
    last_line = (state / "log").read_text().splitlines()[-1]
    assert last_line.startswith("[setup] SGLang venv, made in the background: exit 0 in "), last_line
    current.touch()
    set_up()
    assert not state.exists()


@pytest.mark.slow  # starts bash processes
def test_a_venv_made_by_hand_after_a_failed_background_set_up_lets_the_tiers_run(tmp_path):
    """Was: after a failed background set-up, `bash launch/setup_sglang.sh` by hand (the failure's advice) made
    the venv and the tiers still failed with the old status. launch/setup_sglang.sh, the real one, over a venv
    whose interpreter answers every call with success (its installs and import checks pass at once); a
    background set-up still running keeps its files."""
    for folder in ("launch", "requirements", ".venv-sglang/bin"):
        (tmp_path / folder).mkdir(parents=True)
    for name in ("setup_sglang.sh", "install_torch.sh"):
        shutil.copy2(ROOT / "launch" / name, tmp_path / "launch")
    shutil.copy2(ROOT / "pyproject.toml", tmp_path)
    for name in ("sglang-contract-nodeps.txt", "sglang-live.txt"):
        shutil.copy2(ROOT / "requirements" / name, tmp_path / "requirements")
    python = tmp_path / ".venv-sglang" / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    state = _state(tmp_path)

    def set_up_by_hand() -> None:
        script = tmp_path / "launch" / "setup_sglang.sh"
        env = {k: v for k, v in os.environ.items() if k not in ("GSPO_SGLANG_VENV", "GSPO_REINSTALL")}
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stdout + done.stderr

    set_up_by_hand()  # a background set-up without a status is still running: its files stay
    assert background_setup_started(state)
    (state / "status").write_text("1\n")
    (tmp_path / ".venv-sglang" / ".gspo-sglang-stamp").unlink()  # written above; without it the venv is made again
    set_up_by_hand()  # the venv is made
    wait_for_sglang_setup(timeout_s=0, state=state)
    state = _state(tmp_path)
    (state / "status").write_text("1\n")
    set_up_by_hand()  # the venv is found ready
    wait_for_sglang_setup(timeout_s=0, state=state)
