"""``tools/plan.py --calibrate`` on CPU: it runs the configured job (one rank through the entry point,
two through the launcher), fits, and prints the fitted parameters; checked against the run's own files.

What is checked independently of ``tools/planning/calibrate.py``: the expert imbalance is recomputed here
from the run's ``routing.jsonl``; the timed steps are the run's steps less the first and the
diagnosed ones (read from the files); the fitted update time equals the measured one (the fit
inverts the planner's model: the unit test proves the algebra, this proves it on a real run);
the plan printed after the fit uses the fitted device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _imbalance(path: Path, ep: int) -> float:
    values = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] != "update":
            continue
        for layer in record["expert_load"]:
            per = len(layer) // ep
            shares = [sum(layer[r * per : (r + 1) * per]) for r in range(ep)]
            values.append(ep * max(shares) / sum(shares))
    return sum(values) / len(values)


@pytest.mark.parametrize(("overrides", "gpus"), [([], 1), (["parallel=ep2"], 2)], ids=["one_rank", "ep2"])
def test_calibrate_runs_the_job_and_fits(tmp_path, overrides, gpus):
    out = tmp_path / "fit.json"
    cmd = [
        sys.executable,
        "tools/plan.py",
        *overrides,
        f"--gpus={gpus}",
        "--calibrate",
        f"--calibrate-dir={tmp_path / 'cal'}",
        f"--calibrate-out={out}",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    fit = json.loads(out.read_text())
    run = tmp_path / "cal" / "run"

    assert fit["device"] == "cpu"
    assert 0 < fit["mfu"] <= 1, fit
    assert fit["measured"]["update"] == pytest.approx(fit["predicted"]["update"], rel=1e-6)

    diagnosed = {json.loads(line)["step"] for line in (run / "routing.jsonl").read_text().splitlines()}
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert fit["timed_steps"] == [s for s in steps if s != 1 and s not in diagnosed] != []
    assert 4 in diagnosed  # the last step measured the expert loads

    ep = 2 if gpus == 2 else 1
    assert fit["expert_imbalance"] == pytest.approx(_imbalance(run / "routing.jsonl", ep))
    assert fit["imbalance_by_ep"]["1"] == pytest.approx(1.0)
    assert fit["imbalance_by_ep"]["4"] == pytest.approx(_imbalance(run / "routing.jsonl", 4))

    if gpus == 1:
        assert fit["link_efficiency"] is None and any("no collective" in n for n in fit["notes"])
    else:
        assert fit["link_efficiency"] > 0 and fit["link_bytes_per_s"] > 0
    assert "fitted mfu:" in done.stdout and "(calibrated on cpu)" in done.stdout
