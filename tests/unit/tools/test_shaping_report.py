"""Shaping study summaries: per-run means over the last steps, seed mean/std, change vs baseline."""

import json

import pytest

from study_reports.shaping_report import (
    aggregate,
    read_metrics,
    relative_to_baseline,
    relative_to_vanilla,
    render_markdown,
    summarize_run,
)


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
    relative = relative_to_baseline({"baseline": base, "grsp_keyword": shaped})
    assert relative["grsp_keyword"] == {
        "tokens_change_pct": pytest.approx(-40.0),
        "accuracy_change_points": pytest.approx(0.0),
    }
    table = render_markdown({"baseline": base, "grsp_keyword": shaped}, relative, ["note"])
    assert "50.000 ± 14.142 (n=2)" in table and "tokens_change_pct -40.0" in table and "no figure quoted" in table


def test_change_vs_the_vanilla_model_uses_evaluation_tokens():
    arms = {"step_grpo_dtr": aggregate([{"eval_tokens": 30.0, "eval_accuracy": 0.7, "tokens": 10.0}])}
    vanilla = {"eval/response_length": 40.0, "eval/pass@1": 0.6}
    change = relative_to_vanilla(arms, vanilla)["step_grpo_dtr"]
    assert change == {
        "eval_tokens_change_pct": pytest.approx(-25.0),
        "eval_accuracy_change_points": pytest.approx(10.0),
    }
    table = render_markdown(arms, {"step_grpo_dtr": {}}, [], {"step_grpo_dtr": change})
    assert "eval_tokens_change_pct -25.0" in table and "-32.0% tokens vs the vanilla model" in table


def test_no_claim_the_sources_do_not_contain():
    from study_reports.shaping_report import PAPER_CLAIMS

    text = " ".join(PAPER_CLAIMS.values())
    for unsupported in ("82.1", "79.9", "0.2%"):
        assert unsupported not in text


def test_a_directory_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="finished training run"):
        read_metrics(tmp_path)


def test_seed_means_are_exactly_rounded_so_every_python_regenerates_the_same_report():
    """Python 3.12's sum() of floats compensates, 3.11's does not: the stored shaping report regenerated with 19
    last-digit differences in the newest-stack leg. math.fsum rounds exactly on both (before, on 3.11:
    0.09999999999999999)."""
    stats = aggregate([{"x": 0.1}] * 10)
    assert stats["x"]["mean"] == 0.1
