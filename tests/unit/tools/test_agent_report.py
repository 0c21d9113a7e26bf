"""tools/agent_report.py: the calculator study's summary, by hand on runs stored in a study store."""

from __future__ import annotations

import json

import agent_report

from study_reports.store import save_runs


def _write(path, rewards, tools):
    """A run directory ``path`` (``runs/agent_calculator_s<seed>``) with its metrics.jsonl."""
    rows = [
        {"step": i + 1, "reward/mean": r, "agent/tool_used_frac": t, "routing/rollout_vs_train_changed_frac": 0.0}
        for i, (r, t) in enumerate(zip(rewards, tools, strict=True))
    ]
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _store(study, *runs):
    save_runs(list(runs), study, "agent_study", ("trainer.seed",))


def test_the_summary_reads_the_first_and_last_fifth_and_judges_the_criterion(tmp_path):
    one = _write(tmp_path / "runs" / "agent_calculator_s1", [0.2] * 2 + [0.5] * 6 + [0.9] * 2, [0.3] * 8 + [0.95] * 2)
    two = _write(tmp_path / "runs" / "agent_calculator_s2", [0.5] * 2 + [0.6] * 6 + [0.7] * 2, [0.3] * 8 + [0.95] * 2)
    study = tmp_path / "study"
    _store(study, one, two)
    agent_report.main([str(study)])
    summary = json.loads((study / "summary.json").read_text())
    one, two = summary["seeds"]["1"], summary["seeds"]["2"]
    assert (one["reward_first_20pct"], one["reward_last_20pct"], one["tool_use_last_20pct"]) == (0.2, 0.9, 0.95)
    assert one["criterion_holds"] and not two["criterion_holds"]  # a rise of 0.2 is short of 0.3
    assert not summary["criterion_holds_for_every_seed"]
    assert abs(summary["rise_mean"] - 0.45) < 1e-9 and "commit" in summary["provenance"]
    assert summary["warm_start_eval_pass_at_1"] is None and one["eval_pass_at_1"] == {}


def test_the_greedy_evaluations_of_the_runs_and_of_the_warm_start_are_reported(tmp_path):
    run = _write(tmp_path / "runs" / "agent_calculator_s1", [0.2] * 5, [0.3] * 5)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[2]["eval/pass@1"], rows[4]["eval/pass@1"] = 0.5, 0.75
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    study = tmp_path / "study"
    _store(study, run)
    (study / "warm_start_eval.jsonl").write_text(json.dumps({"step": 1, "eval/pass@1": 0.125}) + "\n")
    agent_report.main([str(study)])
    summary = json.loads((study / "summary.json").read_text())
    assert summary["warm_start_eval_pass_at_1"] == 0.125
    assert summary["seeds"]["1"]["eval_pass_at_1"] == {"3": 0.5, "5": 0.75}
