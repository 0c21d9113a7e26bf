"""The checks every commit must pass, run as part of the README's test command: ruff's lint rules,
ruff's formatter (no file it would change) and mypy on the package and tools/ (configured in
pyproject.toml). Each failure prints the tool's own findings. mypy is `slow` (~45 s on a cold cache),
so the fast tier (`-m "not slow"`) runs the two ruff checks and the full run all three."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _tool(name: str) -> list[str]:
    if importlib.util.find_spec(name) is None:
        pytest.fail(f"{name} is not installed: `pip install -e .[test]` (launch/setup_tests.sh) installs it")
    return [sys.executable, "-m", name]


def test_ruff_lint_finds_nothing():
    done = _run(*_tool("ruff"), "check", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_would_change_nothing():
    done = _run(*_tool("ruff"), "format", "--check", "--diff", ".")
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]


@pytest.mark.slow
def test_mypy_finds_nothing(background_mypy):
    # ~50 s on a cold cache (a fresh clone), seconds with .mypy_cache; started in the background when
    # the tests were collected (tests/conftest.py), so this waits for what is left of it
    _tool("mypy")
    if background_mypy is None:
        done = _run(sys.executable, "-m", "mypy")
        code, findings = done.returncode, done.stdout + done.stderr
    else:
        process, output = background_mypy
        code, findings = process.wait(timeout=600), output.read_text()
    assert code == 0, findings
