"""tools/study_reports/verdict_table.py: docs/studies.md's verdict table is the one the stored reports give; a
changed verdict in a report.json changes the table; a kind without a reader and a doc without markers are
refused by name."""

import json
import shutil
from pathlib import Path

import pytest

from study_reports import verdict_table

REPORTS = Path(__file__).resolve().parents[3] / "reports"


def test_docs_table_equals_the_one_the_stored_reports_give(capsys):
    assert verdict_table.main(["--check"]) == 0
    assert "equals the one the stored reports give" in capsys.readouterr().out


def test_every_pre_registered_study_gives_rows_with_its_verdict():
    text = verdict_table.generated(REPORTS)
    for study in ("e1_routing_shape", "e2_off_policy", "e3_long_responses", "e3_qwen35_shape", "e4_shaping"):
        assert f"`reports/{study}`" in text
    e2 = json.loads((REPORTS / "e2_off_policy" / "report.json").read_text())
    assert f"**{e2['verdict']['verdict']}" in text


def copy_study(tmp_path: Path, study: str) -> Path:
    reports = tmp_path / "reports"
    (reports / study).mkdir(parents=True)
    for name in ("store.json", "report.json"):
        shutil.copy(REPORTS / study / name, reports / study / name)
    return reports


def test_a_changed_verdict_in_a_report_changes_the_table_and_check_fails(tmp_path, capsys):
    reports = copy_study(tmp_path, "e3_long_responses")
    doc = tmp_path / "studies.md"
    doc.write_text(f"intro\n{verdict_table.BEGIN}\nold\n{verdict_table.END}\nrest\n")
    assert verdict_table.main(["--reports", str(reports), "--doc", str(doc), "--write"]) == 0
    assert verdict_table.main(["--reports", str(reports), "--doc", str(doc), "--check"]) == 0
    assert doc.read_text().startswith("intro\n") and doc.read_text().endswith("rest\n")

    report_path = reports / "e3_long_responses" / "report.json"
    report = json.loads(report_path.read_text())
    report["verdict"]["verdict"] = "reproduced"
    report_path.write_text(json.dumps(report))
    capsys.readouterr()
    assert verdict_table.main(["--reports", str(reports), "--doc", str(doc), "--check"]) == 1
    assert "differs from the stored reports" in capsys.readouterr().out


def test_a_report_kind_without_a_reader_is_refused_by_name(tmp_path):
    reports = copy_study(tmp_path, "e2_off_policy")
    store = reports / "e2_off_policy" / "store.json"
    store.write_text(json.dumps({**json.loads(store.read_text()), "report": "new_study_kind"}))
    with pytest.raises(SystemExit, match="'new_study_kind' has no verdict reader"):
        verdict_table.rows_of(reports, "e2_off_policy")


def test_a_doc_without_the_markers_is_refused(tmp_path):
    doc = tmp_path / "studies.md"
    doc.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="expected one line"):
        verdict_table.main(["--reports", str(REPORTS), "--doc", str(doc), "--check"])
