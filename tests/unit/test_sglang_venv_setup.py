"""The SGLang tiers' wait for CI's background set-up of their venv (tests/sglang_venv_setup.py); .ci/run's side
is tests/unit/test_ci_script.py."""

from __future__ import annotations

import threading

import pytest
from sglang_venv_setup import STATUS_ENV, wait_for_sglang_setup


def test_without_a_background_set_up_nothing_waits(monkeypatch):
    monkeypatch.delenv(STATUS_ENV, raising=False)
    wait_for_sglang_setup(timeout_s=0)


def test_a_status_written_while_waiting_ends_the_wait(monkeypatch, tmp_path):
    status = tmp_path / "setup.status"
    monkeypatch.setenv(STATUS_ENV, str(status))
    writer = threading.Thread(target=status.write_text, args=("0\n",))
    writer.start()
    try:
        wait_for_sglang_setup(timeout_s=60)
    finally:
        writer.join(timeout=60)


def test_a_failed_set_up_fails_the_tier_with_its_status_and_its_log(monkeypatch, tmp_path):
    status = tmp_path / "setup.status"
    status.write_text("2\n")
    (tmp_path / "setup.status.log").write_text("ERROR: No matching distribution found for sglang==0.5.23\n")
    monkeypatch.setenv(STATUS_ENV, str(status))
    with pytest.raises(pytest.fail.Exception) as failure:
        wait_for_sglang_setup(timeout_s=60)
    assert "exit status 2" in str(failure.value) and "No matching distribution" in str(failure.value)


def test_a_set_up_that_has_not_ended_fails_the_tier_after_the_bound(monkeypatch, tmp_path):
    status = tmp_path / "setup.status"
    (tmp_path / "setup.status.log").write_text("Collecting sglang==0.5.23\n")
    monkeypatch.setenv(STATUS_ENV, str(status))
    with pytest.raises(pytest.fail.Exception) as failure:
        wait_for_sglang_setup(timeout_s=0)
    assert "had not ended after 0 s" in str(failure.value) and "Collecting sglang" in str(failure.value)
