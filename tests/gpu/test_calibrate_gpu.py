"""``tools/plan.py --calibrate`` on a GPU: the main job in bf16 on one GPU (NCCL collectives timed
with two GPUs), device memory read from the trainer's ``memory/*`` metrics, capacity from the device.

Tolerances (never run yet: no GPU has been lent to this project when it was written): mfu is a
fraction of the preset's bf16 peak, so in (0, 1]; the planner's per-rank peak is within a factor
of 2 of ``max_memory_allocated`` (the tiny model's peak is dominated by the CUDA workspace and the
embedded engine, which the plan counts only roughly at this size); the reserve gap is >= 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("gpus", [1, 2])
def test_calibrate_on_gpu(tmp_path, gpus):
    if gpus > GPUS:
        pytest.skip(f"needs {gpus} GPUs")
    out = tmp_path / "fit.json"
    overrides = ["model.dtype=bfloat16"] + (["parallel=ep2"] if gpus == 2 else [])
    cmd = [sys.executable, "tools/plan.py", *overrides, f"--gpus={gpus}", "--calibrate"]
    cmd += [f"--calibrate-dir={tmp_path / 'cal'}", f"--calibrate-out={out}"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    fit = json.loads(out.read_text())
    print("\n".join(done.stdout.splitlines()[-30:]))
    assert fit["device"] != "cpu"
    assert 0 < fit["mfu"] <= 1, fit
    memory = fit["memory"]
    assert memory["capacity_bytes"] == torch.cuda.get_device_properties(0).total_memory
    assert memory["max_reserved_bytes"] >= memory["max_allocated_bytes"] > 0
    assert 0.5 <= memory["planned_peak_bytes"] / memory["max_allocated_bytes"] <= 2.0, memory
    if gpus == 2:
        assert 0 < fit["link_efficiency"] <= 1.5, fit  # NCCL over NVLink: a fraction of the link
