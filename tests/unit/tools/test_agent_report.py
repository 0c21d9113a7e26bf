"""tools/agent_report.py: the calculator study's summary, by hand on stored-looking runs."""

from __future__ import annotations

import json

import agent_report


def _write(path, rewards, tools):
    rows = [
        {"step": i + 1, "reward/mean": r, "agent/tool_used_frac": t, "routing/rollout_vs_train_changed_frac": 0.0}
        for i, (r, t) in enumerate(zip(rewards, tools, strict=True))
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_summary_reads_the_first_and_last_fifth_and_judges_the_criterion(tmp_path):
    _write(tmp_path / "metrics_s1.jsonl", [0.2] * 2 + [0.5] * 6 + [0.9] * 2, [0.3] * 8 + [0.95] * 2)
    _write(tmp_path / "metrics_s2.jsonl", [0.5] * 2 + [0.6] * 6 + [0.7] * 2, [0.3] * 8 + [0.95] * 2)
    agent_report.main([str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    one, two = summary["seeds"]["1"], summary["seeds"]["2"]
    assert (one["reward_first_20pct"], one["reward_last_20pct"], one["tool_use_last_20pct"]) == (0.2, 0.9, 0.95)
    assert one["criterion_holds"] and not two["criterion_holds"]  # a rise of 0.2 is short of 0.3
    assert not summary["criterion_holds_for_every_seed"]
    assert abs(summary["rise_mean"] - 0.45) < 1e-9 and "commit" in summary["provenance"]
    assert summary["warm_start_eval_pass_at_1"] is None and one["eval_pass_at_1"] == {}


def test_the_greedy_evaluations_of_the_runs_and_of_the_warm_start_are_reported(tmp_path):
    _write(tmp_path / "metrics_s1.jsonl", [0.2] * 5, [0.3] * 5)
    rows = [json.loads(line) for line in (tmp_path / "metrics_s1.jsonl").read_text().splitlines()]
    rows[2]["eval/pass@1"], rows[4]["eval/pass@1"] = 0.5, 0.75
    (tmp_path / "metrics_s1.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "warm_start_eval.jsonl").write_text(json.dumps({"step": 1, "eval/pass@1": 0.125}) + "\n")
    agent_report.main([str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["warm_start_eval_pass_at_1"] == 0.125
    assert summary["seeds"]["1"]["eval_pass_at_1"] == {"3": 0.5, "5": 0.75}
