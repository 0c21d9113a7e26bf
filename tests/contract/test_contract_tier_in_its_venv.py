"""The contract tier, run inside its own venv (.venv-sglang) from the training environment.

Collected only where that venv exists and this interpreter is not it (conftest.contract_tier_placement);
the tier's own tests are then deselected here, so a plain ``python3 -m pytest`` runs them exactly once.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

TIER_TIMEOUT_S = 800  # below pytest's per-test timeout (900 s), so a hang reports the tier's output
CONTRACT_DIR = Path(__file__).resolve().parent


def test_contract_tier_passes_in_its_own_venv(contract_venv: Path):
    repo = CONTRACT_DIR.parents[1]
    # PYTEST_ADDOPTS is this session's (.ci/run sets --junitxml): the tier writes no report over it
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONHOME", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(repo)  # this checkout's package, as the venv's editable install points at it
    result = subprocess.run(
        [str(contract_venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CONTRACT_DIR)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIER_TIMEOUT_S,
    )
    output = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"the contract tier failed in {contract_venv}:\n{output}"
    assert " passed" in result.stdout and "skipped" not in result.stdout, output
