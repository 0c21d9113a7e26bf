"""gspo_megatron/provenance.py and the provenance.json every run directory gets (trainer/run_log.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from gspo_megatron.provenance import PROVENANCE_FILE, code_version, command_line
from gspo_megatron.trainer.run_log import RunLog

ROOT = Path(__file__).resolve().parents[2]


def test_the_commit_is_the_checkout_head():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    version = code_version()
    assert version["commit"] == head and len(head) == 40 and isinstance(version["dirty"], bool)


def test_a_module_run_is_spelled_as_python_dash_m():
    train = str(ROOT / "gspo_megatron" / "train.py")
    assert command_line([train, "--multirun", "trainer.seed=1,2"]) == (
        "python -m gspo_megatron.train --multirun trainer.seed=1,2"
    )
    assert command_line(["tools/compare_runs.py", "multirun/x", "--out", "a b"]) == (
        "python tools/compare_runs.py multirun/x --out 'a b'"
    )


def test_run_log_writes_provenance_and_a_resume_keeps_the_earlier_start(tmp_path):
    def start(resume_step: int) -> dict:
        log = RunLog(
            tmp_path,
            2,
            tensorboard=False,
            wandb_project=None,
            progress=False,
            config_yaml="a: 1\n",
            resume_step=resume_step,
        )
        log.write_config()
        log.close()
        return json.loads((tmp_path / PROVENANCE_FILE).read_text())

    first = start(0)
    assert first["commit"] == code_version()["commit"] and first["command"] and "previous" not in first
    second = start(1)
    assert [p["time"] for p in second["previous"]] == [first["time"]]
    third = start(1)
    assert len(third["previous"]) == 2 and "previous" not in third["previous"][1]
