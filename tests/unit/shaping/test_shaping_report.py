"""Shaping study summaries: per-run means over the last steps, seed mean/std, change vs baseline."""

import json

import pytest

from gspo_megatron.shaping.report import aggregate, read_metrics, relative_to_baseline, render_markdown, summarize_run


def _run(tokens, accuracy, eval_accuracy):
    steps = [
        {
            "step": s + 1,
            "response/length_mean": t,
            "reward/accuracy": accuracy,
            "shaping/segments_per_cluster/0": 2.0,
            "shaping/segments_per_cluster/1": 1.0,
        }
        for s, t in enumerate(tokens)
    ]
    steps[-1].update({"eval/pass@1": eval_accuracy, "eval/response_length": tokens[-1]})
    return steps


def test_summary_aggregate_and_relative_by_hand(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in _run([50, 40, 30], 0.5, 0.6)))
    summary = summarize_run(read_metrics(tmp_path), last_steps=2)
    assert summary == {
        "tokens": 35.0,
        "accuracy": 0.5,
        "segments_c0": 2.0,
        "segments_c1": 1.0,
        "eval_accuracy": 0.6,
        "eval_tokens": 30,
    }
    base = aggregate([{"tokens": 40.0, "accuracy": 0.5}, {"tokens": 60.0, "accuracy": 0.7}])
    assert base["tokens"] == {"mean": 50.0, "std": pytest.approx(14.142135), "n": 2}
    shaped = aggregate([{"tokens": 30.0, "accuracy": 0.6}])
    assert shaped["tokens"] == {"mean": 30.0, "std": 0.0, "n": 1}
    relative = relative_to_baseline({"baseline": base, "grsp": shaped})
    assert relative["grsp"] == {"tokens_change_pct": pytest.approx(-40.0), "accuracy_change_points": pytest.approx(0.0)}
    table = render_markdown({"baseline": base, "grsp": shaped}, relative, ["note"])
    assert "50.000 ± 14.142 (n=2)" in table and "tokens_change_pct -40.0" in table and "GRSP:" in table


def test_a_directory_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="finished training run"):
        read_metrics(tmp_path)
