"""gspo_megatron/core/provenance.py and the provenance.json every run directory gets (run/run_log.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from gspo_megatron.core.provenance import (
    PROVENANCE_FILE,
    WARM_START_FILE,
    code_version,
    command_line,
    same_clean_code,
    warm_start_record,
    weights_sha256,
)
from gspo_megatron.run.run_log import RunLog

ROOT = Path(__file__).resolve().parents[3]


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


def test_a_record_stands_for_this_code_only_at_the_same_clean_commit():
    clean = {"commit": "a" * 40, "dirty": False}
    assert same_clean_code({"commit": "a" * 40, "dirty": False}, clean)
    assert not same_clean_code({"commit": "b" * 40, "dirty": False}, clean)
    assert not same_clean_code({"commit": "a" * 40, "dirty": True}, clean)
    assert not same_clean_code({"commit": "a" * 40}, clean)  # dirty not recorded: cannot vouch
    assert not same_clean_code({"commit": "a" * 40, "dirty": False}, {"commit": "a" * 40, "dirty": True})
    assert not same_clean_code({"commit": "unknown", "dirty": False}, {"commit": "unknown", "dirty": False})


def test_weights_sha256_is_over_the_safetensors_files_in_name_order(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"second")
    (tmp_path / "a.safetensors").write_bytes(b"first")
    (tmp_path / "config.json").write_text("{}")  # not weights
    assert weights_sha256(tmp_path) == hashlib.sha256(b"firstsecond").hexdigest()
    assert warm_start_record(tmp_path) is None and warm_start_record(None) is None
    (tmp_path / WARM_START_FILE).write_text('{"commit": "c"}')
    assert warm_start_record(tmp_path) == {"commit": "c"}


def test_run_log_records_the_inputs_it_is_given(tmp_path):
    log = RunLog(tmp_path, 1, tensorboard=False, wandb_project=None, progress=False, config_yaml="a: 1\n")
    log.write_config(cpu_threads=3, warm_start={"weights_sha256": "f" * 64})
    log.close()
    record = json.loads((tmp_path / PROVENANCE_FILE).read_text())
    assert record["cpu_threads"] == 3 and record["warm_start"] == {"weights_sha256": "f" * 64}
