"""Run a snippet of Python in a fresh interpreter: what a module imports (``sys.modules``) can only be
observed in a process that has imported nothing yet."""

from __future__ import annotations

import subprocess
import sys


def run_in_fresh_interpreter(code: str, timeout: float = 600) -> str:
    """Run ``code`` with this interpreter in a new process; it must exit 0. Returns its stdout, stripped."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()
