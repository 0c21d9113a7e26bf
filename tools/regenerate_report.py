"""Rebuild a study's report from its store alone (``reports/<study>/store.json``, ``stored_runs/``), bit for bit.

    python3 tools/regenerate_report.py reports/routing_stability_miniature           # rewrite the report
    python3 tools/regenerate_report.py reports/routing_stability_miniature --check   # compare; write nothing

The store (``tools/study_reports/store.py``) holds every run's per-step metrics and routing records and a
manifest of what else its numbers depend on; the study runners store their runs first and write the report
with this command, so every stored report is regenerable by construction. ``--check`` writes the report into
a temporary directory and compares its number files (``REPORTS``) with the stored ones as JSON text: equal
means bit for bit, since Python writes a float as the shortest text that reads back as the same float.

Design decisions:
- One registry of report kinds (``REPORTS``: the kind ``store.json`` names -> the writer and the files that
  hold its numbers); an unknown kind is refused with the known ones listed.
- The comparison leaves out the report's own provenance only (``ReportKind.own_provenance``, e.g. the study
  report's ``provenance.generated_by``: the commit, command, directory and time of this regeneration);
  everything else, the runs' provenance, configs and
  paths (``stored_runs/<name>``, the same on every checkout) included, must match.
- The figures and pages (``*.png``, ``*.html``) are not compared: they draw the same numbers, and their bytes
  depend on the matplotlib version.
- A study without a store is refused, naming why: its per-run data was not stored (its README.md says what
  would rerun it).
- ``main(argv)`` returns the exit status: 0 written or equal, 1 differs, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, whatever is installed

from agent_report import summary_from_store
from async_report import write_report as write_async_report
from compare_runs import write_reports

from study_reports import e4_shaping_report, long_response_report, off_policy_report, routing_shape_report
from study_reports.shaping_report import study_files
from study_reports.store import StoredStudy, StoreError, load_store

SHOWN_DIFFERENCES = 20


Writer = Callable[[StoredStudy, Path], str]


@dataclass(frozen=True)
class ReportKind:
    write: Writer  # writes the report into a directory; returns its text tables
    number_files: tuple[str, ...]  # the files that hold the report's numbers and tables
    own_provenance: tuple[str, ...] = ()  # the key path of the report's own provenance (not compared)


def _routing_study(study: StoredStudy, out: Path) -> str:
    return write_reports(study.runs, [], out, study.seed_keys)


def _shaping_study(study: StoredStudy, out: Path) -> str:
    """The shaping study's report (``tools/shaping_study.py``): its runs are named ``<arm>_s<seed>``."""
    runs_by_arm: dict[str, list[list[dict]]] = {}
    for run in study.runs:
        runs_by_arm.setdefault(run.path.name.rsplit("_s", 1)[0], []).append(run.metrics)
    document, markdown = study_files(runs_by_arm, study.inputs)
    (out / "report.json").write_text(json.dumps(document, indent=2))
    (out / "report.md").write_text(markdown)
    return markdown


def _agent_study(study: StoredStudy, out: Path) -> str:
    """An agent study's summary (``tools/agent_report.py``: the calculator and the fact-lookup studies): its runs
    are named ``<name>_s<seed>``."""
    summary = summary_from_store(study)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return json.dumps({key: value for key, value in summary.items() if key != "provenance"}, indent=2)


def _write_json_report(out: Path, document: dict, markdown: str) -> str:
    """``report.json`` and ``report.md`` of a pre-registered study (E1-E4); the markdown is what is printed."""
    (out / "report.json").write_text(json.dumps(document, indent=2) + "\n")
    (out / "report.md").write_text(markdown)
    return markdown


def _routing_shape_study(study: StoredStudy, out: Path) -> str:
    """Study E1's report (``study_reports/routing_shape_report.py``): arms by routing shape and updates per rollout;
    a study of another shape (E1 on Qwen3.5's) read beside E1's stored arms."""
    reference = routing_shape_report.reference_runs(study.directory, study.runs)
    return _write_json_report(out, *routing_shape_report.study_files(study.runs, study.manifests, reference))


def _study_files_report(compute: Callable[[list, dict], tuple[dict, str]]) -> Writer:
    """The writer of a report kind whose module computes ``(report.json, report.md)`` from the runs and their
    manifests alone: E2 (``off_policy_report``), E3 (``long_response_report``), E4 (``e4_shaping_report``)."""

    def write(study: StoredStudy, out: Path) -> str:
        return _write_json_report(out, *compute(study.runs, study.manifests))

    return write


REPORTS: dict[str, ReportKind] = {
    "routing_study": ReportKind(_routing_study, ("study.json", "comparison.json"), ("provenance", "generated_by")),
    "shaping_study": ReportKind(_shaping_study, ("report.json",)),  # its notes are the study's own record
    "agent_study": ReportKind(_agent_study, ("summary.json",), ("provenance",)),
    "async_study": ReportKind(write_async_report, ("report.json",)),  # tools/async_report.py
    "routing_shape_study": ReportKind(_routing_shape_study, ("report.json",)),
    "long_response_study": ReportKind(_study_files_report(long_response_report.study_files), ("report.json",)),
    "e4_shaping_study": ReportKind(_study_files_report(e4_shaping_report.study_files), ("report.json",)),
    "off_policy_study": ReportKind(_study_files_report(off_policy_report.study_files), ("report.json",)),
}


def report_kind(name: str) -> ReportKind:
    if name not in REPORTS:
        raise StoreError(f"store.json names report {name!r}; known: {', '.join(sorted(REPORTS))}")
    return REPORTS[name]


def write_report(study_dir: Path) -> str:
    """Write ``study_dir``'s report from its store (the study runners' last step); returns its text."""
    study = load_store(study_dir)
    return report_kind(study.report).write(study, study_dir)


def comparable(document, own_provenance: tuple[str, ...]):
    """The JSON document less the report's own provenance (who regenerated it, when), at ``own_provenance``."""
    if not own_provenance or not isinstance(document, dict) or own_provenance[0] not in document:
        return document
    head, rest = own_provenance[0], own_provenance[1:]
    if not rest:
        return {k: v for k, v in document.items() if k != head}
    return {**document, head: comparable(document[head], rest)}


def differences(stored, regenerated, where: str = "") -> Iterator[str]:
    """JSON paths where two documents differ, compared as their JSON text (NaN equals NaN, 0.1 != 0.1000001)."""
    if isinstance(stored, dict) and isinstance(regenerated, dict):
        for key in sorted(set(stored) | set(regenerated)):
            if key not in stored or key not in regenerated:
                yield f"{where}/{key}: only in the {'regenerated' if key not in stored else 'stored'} report"
            else:
                yield from differences(stored[key], regenerated[key], f"{where}/{key}")
    elif isinstance(stored, list) and isinstance(regenerated, list) and len(stored) == len(regenerated):
        for index, (a, b) in enumerate(zip(stored, regenerated, strict=True)):
            yield from differences(a, b, f"{where}/{index}")
    elif json.dumps(stored) != json.dumps(regenerated):
        yield f"{where or '/'}: stored {json.dumps(stored)[:80]}, regenerated {json.dumps(regenerated)[:80]}"


def check(study_dir: Path, kind: ReportKind, study: StoredStudy) -> list[str]:
    """Every difference between the stored report's number files and the ones the store regenerates."""
    found = []
    with tempfile.TemporaryDirectory(prefix="regenerated_report_") as scratch:
        kind.write(study, Path(scratch))
        for name in kind.number_files:
            stored_path = study_dir / name
            if not stored_path.is_file():
                found.append(f"{name}: the study directory has none")
                continue
            stored = comparable(json.loads(stored_path.read_text(encoding="utf-8")), kind.own_provenance)
            regenerated = comparable(
                json.loads((Path(scratch) / name).read_text(encoding="utf-8")), kind.own_provenance
            )
            found += [f"{name}{line}" for line in differences(stored, regenerated)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="regenerate_report", description=__doc__.split("\n")[0])
    parser.add_argument("study", help="the study's directory, holding store.json (e.g. reports/<study>)")
    parser.add_argument("--check", action="store_true", help="compare with the stored report; write nothing")
    args = parser.parse_args(argv)
    study_dir = Path(args.study)
    try:
        study = load_store(study_dir)
        kind = report_kind(study.report)
    except StoreError as err:
        print(f"regenerate_report: error: {err}", file=sys.stderr)
        return 2
    if not args.check:
        print(kind.write(study, study_dir))
        print(f"\nwrote the report of {len(study.runs)} stored runs into {study_dir}")
        return 0
    found = check(study_dir, kind, study)
    if found:
        print(f"regenerate_report: {len(found)} differences from the stored report:", file=sys.stderr)
        for line in found[:SHOWN_DIFFERENCES]:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"{study_dir}: {', '.join(kind.number_files)} regenerate bit for bit from {len(study.runs)} stored runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
