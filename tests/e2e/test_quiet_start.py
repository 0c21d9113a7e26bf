"""The main job's first screen: no third-party warning beyond the reviewed list (core/known_warnings.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gspo_megatron.core.known_warnings import optional_accelerators_notice
from gspo_megatron.testing.train_runs import WARNING_LINE

pytestmark = pytest.mark.e2e


def test_main_job_shows_no_unreviewed_warning(tmp_path):
    # the command: deprecations that will break us are errors, everything else must not show
    command = [sys.executable, "-W", "error::FutureWarning", "-m", "gspo_megatron.train", "trainer.steps=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    result = subprocess.run(
        [*command, f"run_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=600
    )
    screen = result.stdout + result.stderr
    assert result.returncode == 0, screen[-4000:]
    assert "run summary: 2 steps" in result.stdout
    assert WARNING_LINE.findall(screen) == [], screen[-4000:]
    notice = optional_accelerators_notice()
    assert screen.count("not installed") == (0 if notice is None else 1), screen[-4000:]
    if notice is not None:
        assert notice in result.stdout
