"""A 2-step miniature of the whole routing-stability study: the real sweep command (all four
algorithms, 2 seeds, bf16 engine) on the tiny model (``+experiment=routing_stability_miniature``),
then ``tools/compare_runs.py`` on the sweep directory; the report's aggregated numbers are checked
against the runs' own metrics files, and against the stored miniature report
(``reports/routing_stability_miniature``, written by ``bash tools/routing_study.sh
routing_stability_miniature``) within the seed spread: the stored report regenerates from this code."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.core.run_dir import read_jsonl

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = ["gspo", "grpo", "grpo_routing_replay", "grpo_rollout_routing_replay"]
STORED = ROOT / "reports" / "routing_stability_miniature" / "study.json"


def _mean(values):
    return sum(values) / len(values)


@pytest.mark.timeout(1800)  # 8 short runs in one process; minutes on a quiet machine
def test_study_miniature_report_matches_the_runs(tmp_path):
    sweep = tmp_path / "multirun"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [
        sys.executable,
        "-m",
        "gspo_megatron.train",
        "--multirun",
        "+experiment=routing_stability_miniature",
        f"hydra.sweep.dir={sweep}",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(runs) == 8 and (sweep / "multirun.yaml").is_file()

    out = tmp_path / "report"
    report = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compare_runs.py"), str(sweep), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert report.returncode == 0, report.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    groups = {g["label"]: g for g in study["groups"]}
    assert set(groups) == set(ALGORITHMS)  # seeds pooled, one group per algorithm (upr fixed)

    for algorithm, group in groups.items():
        assert len(group["runs"]) == 2
        metrics = [read_jsonl(Path(run) / "metrics.jsonl") for run in group["runs"]]
        final_rewards = [m[-1]["reward/mean"] for m in metrics]
        assert group["stats"]["final reward"]["mean"] == pytest.approx(_mean(final_rewards))
        clip = [_mean([r["loss/clip_frac_token"] for r in m]) for m in metrics]
        assert group["stats"]["clip frac token"]["mean"] == pytest.approx(_mean(clip))
        mismatch = [_mean([r["mismatch/abs_log_prob_diff_mean"] for r in m]) for m in metrics]
        assert group["stats"]["log-prob mismatch"]["mean"] == pytest.approx(_mean(mismatch))
        assert group["stats"]["log-prob mismatch"]["mean"] > 0  # the bf16 engine differs from the trainer
        engine = [_mean([r["routing/rollout_vs_train_changed_frac"] for r in m]) for m in metrics]
        assert group["stats"]["engine vs trainer expert sets changed"]["mean"] == pytest.approx(_mean(engine))
        if algorithm == "grpo_rollout_routing_replay":
            assert group["stats"]["engine vs trainer expert sets changed"]["mean"] == 0.0
        else:  # free routing after one update, from the trainer's own per-step metric
            update = [_mean([r["routing/update_changed_frac"] for r in m]) for m in metrics]
            assert group["stats"]["expert sets changed / update"]["mean"] == pytest.approx(_mean(update))
            spread = group["stats"]["expert sets changed / update"]["std"]
            expected = math.sqrt(sum((u - _mean(update)) ** 2 for u in update))  # n - 1 = 1
            assert spread == pytest.approx(expected, abs=1e-12)
    assert len(study["paper_vs_ours"]) == 5 and all(row["verdict"] for row in study["paper_vs_ours"])
    assert (out / "study.html").read_text().count('id="paper-vs-ours"') == 1

    # provenance: one commit for all runs, each run's command and seed recorded, no warning
    sources = study["provenance"]
    (commit,) = sources["commits"]
    assert sources["warnings"] == [] or commit.endswith("+dirty")  # a test run from uncommitted code warns
    assert {record["seeds"]["trainer.seed"] for record in sources["runs"].values()} == {1, 2}
    assert all("gspo_megatron.train --multirun" in r["command"] for r in sources["runs"].values())

    # the mechanism: where the loss replays the old routing (R2, R3) the routing part is exactly 0
    for algorithm in ("grpo_routing_replay", "grpo_rollout_routing_replay"):
        for run in groups[algorithm]["runs"]:
            for record in read_jsonl(Path(run) / "metrics.jsonl"):
                assert record["ratio_decomp/token_changed_frac"] == 0.0
                assert record["ratio_decomp/token_unchanged_abs_routing"] == 0.0

    # the stored miniature regenerates: every stored group mean within twice the seed spread
    stored = {g["label"]: g["stats"] for g in json.loads(STORED.read_text())["groups"]}
    assert set(stored) == set(groups)
    for label, stats in stored.items():
        for name, old in stats.items():
            new = groups[label]["stats"][name]
            if old["mean"] is None:
                assert new["mean"] is None, (label, name)
                continue
            tolerance = 2 * max(old["std"], new["std"] or 0.0) + 1e-6 * max(1.0, abs(old["mean"]))
            assert abs(new["mean"] - old["mean"]) <= tolerance, (label, name, new["mean"], old["mean"])
