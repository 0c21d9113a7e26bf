"""Where a run's files go: with ``run_dir=`` given, everything -- Hydra's ``.hydra/`` and ``train.log``
among them -- goes into the run directory and nothing into the working directory (issue 63 item 8)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

import gspo_megatron
from gspo_megatron.testing.train_runs import FAST, train_command

pytestmark = pytest.mark.e2e

REPO = Path(gspo_megatron.__file__).resolve().parents[1]


def test_run_dir_given_writes_nothing_into_the_working_directory(tmp_path):
    """Before: every run wrote ``./runs/<date>_<alg>/.hydra/`` and ``train.log`` into the working directory
    even with ``run_dir=`` set, and the dataset's warnings went there. One prompt past the tiny model's
    context makes the dataset warn (dropped and counted), so the log is seen to hold the run's records."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"max {n}=", "answer": max(str(n))} for n in range(100, 120)]
    rows.append({"prompt": "max " + "7" * 300 + "=", "answer": "7"})
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = FAST + [
        "task.name=jsonl",
        f"task.dataset.path={data}",
        "task.reward=last_number",
        "task.dataset.apply_chat_template=false",
    ]
    working, run_dir = tmp_path / "working", tmp_path / "run"
    working.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        train_command(overrides, run_dir), cwd=working, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in working.iterdir()) == []
    assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) == [f"run_dir={run_dir}", *overrides]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / ".hydra" / "hydra.yaml").is_file()
    assert "too_long=1" in (run_dir / "train.log").read_text()
