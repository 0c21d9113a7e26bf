"""Routing report rendered from a synthetic run directory built here."""

import json

import pytest

from gspo_megatron.core.run_dir import JsonlLog
from gspo_megatron.policy.routing.log import RoutingLog
from gspo_megatron.run.routing_report import write_routing_report

METRICS = [
    {"step": 0, "reward/mean": 0.1, "loss/clip_frac_token": 0.1, "loss/clip_frac_seq": 0.0},
    {"step": 1, "reward/mean": 0.2, "loss/clip_frac_token": 0.2, "loss/clip_frac_seq": 0.1},
    {"step": 2, "reward/mean": 0.3, "loss/clip_frac_token": 0.3, "loss/clip_frac_seq": 0.2},
    {"step": 3, "reward/mean": 0.5, "loss/clip_frac_token": 0.4, "loss/clip_frac_seq": 0.3},
]


def _routing(step, kind, changed, overlap, load=None):
    record = {
        "step": step,
        "kind": kind,
        "changed_frac": changed,
        "overlap": overlap,
        "changed_frac_overall": sum(changed) / len(changed),
        "overlap_overall": sum(overlap) / len(overlap),
        "tokens": 100,
    }
    if load is not None:
        record["expert_load"] = load
        record["load_imbalance"] = [max(row) * len(row) for row in load]
    return record


def make_run(path, with_routing=True):
    path.mkdir()
    (path / "config.yaml").write_text("algorithm:\n  name: gspo\n")
    with JsonlLog(path / "metrics.jsonl") as log:
        for record in METRICS:
            log.append(record)
    if with_routing:
        with RoutingLog(path) as log:
            log.append(_routing(0, "update", [0.1, 0.3], [0.9, 0.8]))
            log.append(_routing(0, "rollout_vs_train", [0.05, 0.15], [0.95, 0.9]))
            log.append(_routing(2, "update", [0.3, 0.5], [0.8, 0.7], load=[[0.5, 0.5, 0, 0], [0.25] * 4]))
    return path


def test_report_json_numbers(tmp_path):
    json_path, _ = write_routing_report(make_run(tmp_path / "run"))
    summary = json.loads(json_path.read_text())
    assert summary["label"] == "gspo" and summary["steps"] == 4 and summary["last_step"] == 3
    assert summary["final_reward"] == pytest.approx(0.5)
    assert summary["clip_frac_token_mean"] == pytest.approx(0.25)
    assert summary["clip_frac_seq_mean"] == pytest.approx(0.15)
    assert summary["clip_frac_seq_final"] == pytest.approx(0.3)
    update = summary["routing"]["update"]
    assert update["records"] == 2 and update["tokens"] == 200
    assert update["changed_frac"] == pytest.approx([0.2, 0.4])
    assert update["overlap"] == pytest.approx([0.85, 0.75])
    assert update["changed_frac_overall"] == pytest.approx(0.3)
    assert update["load_imbalance"] == pytest.approx([2.0, 1.0])
    assert summary["routing"]["rollout_vs_train"]["changed_frac_overall"] == pytest.approx(0.1)
    assert list(summary["routing"]) == ["update", "rollout_vs_train"]


def test_report_html_is_self_contained_with_sections(tmp_path):
    _, html_path = write_routing_report(make_run(tmp_path / "run"))
    page = html_path.read_text()
    for section in ("summary", "volatility", "expert-load", "training-curves"):
        assert f'<section id="{section}">' in page
    # volatility x2 kinds, expert load, training curves
    assert page.count('src="data:image/png;base64,iVBORw0KGgo') == 4
    assert "<h3>update</h3>" in page and "<h3>rollout_vs_train</h3>" in page
    assert "http" not in page.replace("<!DOCTYPE html>", "")  # no external assets


def test_report_without_routing(tmp_path):
    json_path, html_path = write_routing_report(make_run(tmp_path / "run", with_routing=False))
    assert json.loads(json_path.read_text())["routing"] == {}
    page = html_path.read_text()
    assert "No routing diagnostics recorded" in page and "No expert-load records" in page
    assert page.count("data:image/png;base64,") == 1  # training curves only


def test_report_without_charts_has_the_same_numbers_and_says_how_to_draw_them(tmp_path):
    """logging.charts=false: the JSON is the same, the page keeps its tables, each of the 4 figures is
    replaced by the note naming the command that draws it (which then does)."""
    from gspo_megatron.run.routing_report import NOT_DRAWN, main

    json_path, html_path = write_routing_report(make_run(tmp_path / "run"), charts=False)
    page, numbers = html_path.read_text(), json_path.read_text()
    assert "data:image/png" not in page and page.count(NOT_DRAWN) == 4
    assert "<h3>update</h3>" in page and "<table" in page
    assert main([str(tmp_path / "run")]) == 0
    assert html_path.read_text().count('src="data:image/png;base64,iVBORw0KGgo') == 4
    assert json_path.read_text() == numbers


def test_report_cli(tmp_path, capsys):
    from gspo_megatron.run.routing_report import main

    assert main([str(make_run(tmp_path / "run"))]) == 0
    assert (tmp_path / "run" / "routing_report.html").is_file()
    assert main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _zero_engine_run(path, config_yaml: str):
    path.mkdir()
    (path / "config.yaml").write_text(config_yaml)
    with JsonlLog(path / "metrics.jsonl") as log:
        for record in METRICS:
            log.append(record)
    with RoutingLog(path) as log:
        for step in (1, 2):
            log.append(_routing(step, "update", [0.1, 0.3], [0.9, 0.8]))
            log.append(_routing(step, "rollout_vs_train", [0.0, 0.0], [1.0, 1.0]))
    return path


FP32_EMBEDDED = (
    "algorithm:\n  name: gspo\n  routing_replay: none\n"
    "model:\n  dtype: float32\n"
    "rollout:\n  engine: embedded\n  embedded:\n    dtype: {engine}\n"
)


@pytest.mark.parametrize(
    "config_yaml, reason",
    [
        (FP32_EMBEDDED.format(engine="float32"), "Zero as expected: the embedded engine computes in float32"),
        (FP32_EMBEDDED.format(engine="float32").replace("none", "rollout"), "Zero by construction: R3"),
        (FP32_EMBEDDED.format(engine="bfloat16"), "Every record is exactly zero"),
    ],
)
def test_an_all_zero_engine_vs_trainer_panel_says_why(tmp_path, config_yaml, reason):
    json_path, html_path = write_routing_report(_zero_engine_run(tmp_path / "run", config_yaml))
    routing = json.loads(json_path.read_text())["routing"]
    assert routing["rollout_vs_train"]["zero_reason"].startswith(reason)
    assert routing["update"]["zero_reason"] is None  # a nonzero panel needs no explanation
    assert reason in html_path.read_text()


def test_a_nonzero_engine_vs_trainer_panel_has_no_zero_note(tmp_path):
    json_path, _ = write_routing_report(make_run(tmp_path / "run"))
    assert json.loads(json_path.read_text())["routing"]["rollout_vs_train"]["zero_reason"] is None


def test_layers_are_the_models_own_and_dense_and_shared_ones_are_named(tmp_path):
    """GLM-4.5's first layer is dense: the two routed series are model layers 1 and 2, and the report
    says the dense layer and the shared expert are not in its tables."""
    run = make_run(tmp_path / "run")
    model = "model:\n  num_layers: 3\n  dense_layers: [0]\n  shared_expert_intermediate_size: 64\n"
    (run / "config.yaml").write_text("algorithm:\n  name: gspo\n" + model)
    _, html_path = write_routing_report(run, charts=False)
    page = html_path.read_text()
    assert "dense layers [0] have no router" in page and "the shared expert runs for every token, unrouted" in page
    update = page.split("<h3>update</h3>")[1].split("<h3>")[0]
    assert [row.split("</td>")[0] for row in update.split("<tr><td>")[1:]] == ["1", "2"]


def test_per_turn_records_are_summarised_apart_and_leave_the_whole_unchanged(tmp_path):
    run = make_run(tmp_path / "run")
    with RoutingLog(run) as log:
        for step in (0, 2):  # two turns of a multi-turn run, beside the whole's records of the same steps
            log.append({**_routing(step, "update", [0.0, 0.2], [1.0, 0.9]), "turn": 0, "tokens": 60})
            log.append({**_routing(step, "update", [0.4, float("nan")], [0.8, 0.7]), "turn": 1, "tokens": 40})
    with JsonlLog(run / "metrics.jsonl") as log:
        log.append({"step": 4, "ratio_decomp/turn_1/token_var_share_routing": 0.25, "ratio_decomp/turn_1/x": 9.0})
    json_path, html_path = write_routing_report(run)
    summary = json.loads(json_path.read_text())
    update = summary["routing"]["update"]
    assert update["records"] == 2 and update["changed_frac_overall"] == pytest.approx(0.3)  # as without turns
    per_turn = summary["routing_per_turn"]["update"]
    assert per_turn["0"]["tokens"] == 120 and per_turn["0"]["changed_frac"] == pytest.approx([0.0, 0.2])
    assert per_turn["1"]["changed_frac"][0] == pytest.approx(0.4) and per_turn["1"]["changed_frac"][1] is None
    assert summary["routing_per_turn"]["ratio_decomposition"] == {"1": {"token_var_share_routing": 0.25}}
    page = html_path.read_text()
    assert '<section id="per-turn">' in page and "token_var_share_routing" in page


def test_a_single_turn_run_has_no_per_turn_summary(tmp_path):
    json_path, html_path = write_routing_report(make_run(tmp_path / "run"))
    assert "routing_per_turn" not in json.loads(json_path.read_text())
    assert "Single-turn samples" in html_path.read_text()
