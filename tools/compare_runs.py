"""Compare training runs side by side, and aggregate a sweep's seeds (e.g. the routing-stability study).

    python tools/compare_runs.py runs/gspo runs/grpo runs/grpo_replay --out runs/comparison
    python tools/compare_runs.py multirun/<date> --out reports/routing_stability     # a whole sweep

Arguments are run directories or sweep directories (Hydra's ``multirun/<date>``: expanded into its
runs); files such as ``multirun.yaml`` (matched by ``multirun/<date>/*``) are skipped with a note.
Writes ``OUT/comparison.png`` (reward, clip fraction, routing volatility per diagnostic kind; one
line per run), ``OUT/comparison.html`` (the table and the figure, self-contained),
``OUT/comparison.json`` (every run's summary), and the seed-aggregated study report
``OUT/study.html`` / ``OUT/study.json`` (runs grouped by config, mean ± std over ``--seed-key``;
curves with seed bands, per-layer volatility, ratio dispersion by length, "paper vs ours" table;
``tools/study_reports/study_report.py``), and prints both tables to stdout.

Design decisions:
- Runs are read through ``gspo_megatron.core.run_dir`` (the format is documented there) and
  summarised with the same ``summarize_run`` as the single-run report, so the numbers agree.
- A run is labelled by ``algorithm.name`` from its config.yaml (else its directory name); runs that
  share a label (GRPO with and without replay) get their directory name appended.
- Volatility columns are the step mean of each kind's overall changed fraction; a run that did not
  record a kind shows "-".
- The study report records where it came from (``study_reports/report_provenance.py``): its own commit
  and command, each run's commit, command, seeds and composed config; runs from different commits
  (or from uncommitted code, or that recorded none) are reported with a warning on stderr.
- Verdicts ("paper vs ours") and the seed-aggregated terminal table read each run over the run summary's
  "last 20%" of steps (``study_report.VERDICT_WINDOW``, named in the output), and no verdict is given below
  ``study_report.MIN_SEEDS`` (3) runs per compared arm: with fewer the seed spread is unknown or a guess,
  and single-seed verdicts flipped between tasks. The numbers are still shown, with "n too small".
- The terminal shows narrow tables: per run (run, final reward, clip fractions, one volatility column per
  diagnostic kind) and per group (``study_report.TERMINAL_COLUMNS``: reward, clip fractions, experts changed
  per update, engine vs trainer, log-prob mismatch); every column is in ``study.html``'s full table.
- ``main(argv)`` returns the exit status (0 ok, 2 bad input) so tests and scripts can call it.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, whatever is installed

from gspo_megatron.core.run_dir import RunData, RunDirError, load_run
from gspo_megatron.run.routing_plots import Panel, Series, figure_png, line_panels
from gspo_megatron.run.routing_report import (
    format_number,
    html_page,
    html_table,
    json_safe,
    ordered_kinds,
    png_img,
    summarize_run,
    training_panels,
)
from study_reports.aggregate import DEFAULT_SEED_KEYS, expand_run_paths, group_runs
from study_reports.report_provenance import runs_provenance
from study_reports.study_report import study_report

BASE_COLUMNS = ["run", "final reward", "clip frac tok", "clip frac seq"]
PER_RUN_WINDOWS = (
    "(per run: final reward is the last step's; clip fractions and volatility are means over the whole run, "
    "comparison.json's *_mean; the seed-aggregated table below reads the last 20%)"
)


def distinct_labels(runs: list[RunData]) -> list[RunData]:
    """Runs that share a label (GRPO with and without replay) get their directory name appended."""
    counts = Counter(run.label for run in runs)
    for run in runs:
        if counts[run.label] > 1:
            run.label = f"{run.label} ({run.path.resolve().name})"
    return runs


def comparison_rows(summaries: list[dict], kinds: list[str]) -> tuple[list[str], list[list]]:
    headers = BASE_COLUMNS + [f"vol {kind}" for kind in kinds]
    rows = []
    for s in summaries:
        row = [s["label"], s["final_reward"], s["clip_frac_token_mean"], s["clip_frac_seq_mean"]]
        row += [s["routing"].get(kind, {}).get("changed_frac_overall") for kind in kinds]
        rows.append(row)
    return headers, rows


def text_table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[format_number(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def volatility_panels(runs: list[RunData], kinds: list[str]) -> list[Panel]:
    panels = []
    for kind in kinds:
        panel = Panel(f"routing volatility: {kind}", "expert set changed (fraction)")
        for index, run in enumerate(runs):
            records = [r for r in run.routing_records(kind) if "changed_frac_overall" in r]
            panel.series.append(
                Series(
                    run.label,
                    [r["step"] for r in records],
                    [r["changed_frac_overall"] for r in records],
                    color=f"C{index % 10}",
                )
            )
        panels.append(panel)
    return panels


def compare(paths: list[str], out_dir: str | Path, seed_keys=DEFAULT_SEED_KEYS) -> str:
    """Write the comparison and study files into ``out_dir`` and return the text tables."""
    run_paths, skipped = expand_run_paths(paths)
    for path in skipped:
        print(f"compare_runs: skipping {path} (not a run directory)", file=sys.stderr)
    if not run_paths:
        raise RunDirError(f"no run directories among {paths}")
    runs = [load_run(path) for path in run_paths]
    return write_reports(runs, [str(p) for p in skipped], out_dir, seed_keys)


def write_reports(runs: list[RunData], skipped: list[str], out_dir: str | Path, seed_keys=DEFAULT_SEED_KEYS) -> str:
    """The comparison and study files of ``runs`` (read from run directories or from a study's store,
    ``tools/regenerate_report.py``) into ``out_dir``; returns the text tables."""
    runs = distinct_labels(runs)
    sources = runs_provenance(runs)  # before any file is written: rewriting a stored report is no "change"
    for warning in sources["warnings"]:
        print(f"compare_runs: warning: {warning}", file=sys.stderr)
    summaries = [summarize_run(run) for run in runs]
    # "update" is always plotted (it is the headline diagnostic), even when no run recorded it.
    kinds = ordered_kinds({"update"} | {k for run in runs for k in run.routing_kinds()})
    headers, rows = comparison_rows(summaries, kinds)
    table = text_table(headers, rows) + "\n" + PER_RUN_WINDOWS
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = figure_png(line_panels(training_panels(runs) + volatility_panels(runs, kinds)))
    (out / "comparison.png").write_bytes(png)
    (out / "comparison.json").write_text(json.dumps(summaries, indent=2) + "\n", encoding="utf-8")
    items = "".join(f"<li>{html.escape(s['label'])}: {html.escape(s['run_dir'])}</li>" for s in summaries)
    run_list = f"<ul>{items}</ul>"
    page = html_page(
        "Run comparison: " + ", ".join(s["label"] for s in summaries),
        [
            ("table", "Summary", html_table(headers, rows) + run_list),
            ("curves", "Reward, clip fraction and routing volatility", png_img(png, "comparison")),
        ],
    )
    (out / "comparison.html").write_text(page, encoding="utf-8")
    summary, study_page, study_text = study_report(group_runs(runs, seed_keys), skipped, sources)
    (out / "study.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n", encoding="utf-8")
    (out / "study.html").write_text(study_page, encoding="utf-8")
    return table + "\n\nseed-aggregated (study.html):\n" + study_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compare_runs", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl) or sweep directories")
    parser.add_argument("--out", required=True, help="directory for comparison.{html,png,json} and study.{html,json}")
    parser.add_argument(
        "--seed-key",
        action="append",
        default=None,
        help=f"config key whose runs are seeds of one group (repeatable; default {DEFAULT_SEED_KEYS})",
    )
    args = parser.parse_args(argv)
    try:
        table = compare(args.runs, args.out, tuple(args.seed_key or DEFAULT_SEED_KEYS))
    except RunDirError as err:
        print(f"compare_runs: error: {err}", file=sys.stderr)
        return 2
    print(table)
    print(f"\nwrote {Path(args.out) / 'comparison.html'}, comparison.png and study.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
