"""Routing report of one run: ``<run>/routing_report.json`` (numbers) and ``routing_report.html`` (plots).

Design decisions:
- Reads only the run directory (format in ``core/run_dir.py``), so a report can be written while
  training runs, after it, or for a run copied off a cluster; no trainer object is needed.
- Summaries average over *steps* (each diagnostic step weighs the same, as the curves show them);
  the per-step numbers themselves are exact token-weighted fractions (see ``volatility.py``).
- The HTML is self-contained: PNGs embedded as base64 data URIs, no scripts, no external assets,
  so it can be mailed or attached to an issue as one file.
- JSON output holds only finite numbers: NaN/inf (e.g. a step with no valid tokens) become null.
- The summary and HTML helpers are shared with ``tools/compare_runs.py``.
- ``charts=False`` (the trainer's ``logging.charts=false``) writes the same JSON and tables without
  drawing a figure (1-3 s of matplotlib on 2 cores); each figure's place says how to draw it later.
- A panel that is exactly zero says why (``zero_panel_reason``), read from the run's config: the
  engine-vs-trainer comparison is zero by construction under R3 and expected when the engine computes
  in the trainer's precision (the default fp32 embedded engine), not a broken diagnostic.
- Every number the run summary printed at the end of the job (``run/run_log.py``) is here too under the same
  window label ("first 20%", "last 20%", "whole run": ``core/run_dir.py``'s ``window_mean``), so equal labels
  mean equal numbers; the older keys (``clip_frac_seq_mean``: the whole run, ``final_reward``: the last step)
  stay for the tools that read them.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from gspo_megatron.core.run_dir import (
    CLIP_FRAC_SEQ_KEY,
    CLIP_FRAC_TOKEN_KEY,
    REWARD_KEY,
    WINDOWS,
    RunData,
    RunDirError,
    finite_mean,
    load_run,
    window_mean,
    write_run_file,
)
from gspo_megatron.policy.routing.config import DIAGNOSTIC_KINDS, DiagnosticKind
from gspo_megatron.policy.routing.replay import ReplayMode
from gspo_megatron.rollout.config import RolloutEngineName
from gspo_megatron.run.routing_plots import (
    Panel,
    Series,
    expert_load_figure,
    figure_png,
    line_panels,
    volatility_figure,
)

REPORT_JSON = "routing_report.json"
REPORT_HTML = "routing_report.html"
# the metrics.jsonl keys the run summary prints, with the summary's names for them
WINDOWED_METRICS = {
    REWARD_KEY: "reward/mean",
    "response/length_mean": "response length",
    CLIP_FRAC_SEQ_KEY: "clip frac (seq)",
    CLIP_FRAC_TOKEN_KEY: "clip frac (token)",
}


def json_safe(value: Any) -> Any:
    """Replace non-finite floats by None, recursively (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _layer_mean(run: RunData, kind: str, key: str, records: list[dict]) -> list[float] | None:
    rows = [r[key] for r in records if key in r]
    if not rows:
        return None
    widths = {len(row) for row in rows}
    if len(widths) != 1:
        raise RunDirError(
            f"{run.path}: routing records of kind {kind!r} disagree on the layer count of {key!r}: {sorted(widths)}"
        )
    stacked = np.array(rows, dtype=float)
    finite = np.isfinite(stacked)
    counts = finite.sum(axis=0)
    sums = np.where(finite, stacked, 0.0).sum(axis=0)
    # the mean over the finite values; a layer with none (a turn no trajectory reached) stays NaN (-> null)
    return [float(total / count) if count else math.nan for total, count in zip(sums, counts, strict=True)]


def routing_kind_summary(run: RunData, kind: str) -> dict:
    """Step-mean volatility per layer and overall for one diagnostic kind."""
    records = run.routing_records(kind)
    summary: dict[str, Any] = {
        "records": len(records),
        "first_step": records[0]["step"] if records else None,
        "last_step": records[-1]["step"] if records else None,
        "tokens": sum(int(r.get("tokens", 0)) for r in records),
        "changed_frac_overall": finite_mean([r.get("changed_frac_overall") for r in records]),
        "overlap_overall": finite_mean([r.get("overlap_overall") for r in records]),
        "experts_changed_per_slot": finite_mean([r.get("experts_changed_per_slot") for r in records]),
        "changed_any_frac": finite_mean([r.get("changed_any_frac") for r in records]),
        "changed_frac_overall_windows": {
            window: window_mean([r.get("changed_frac_overall") for r in records], window) for window in WINDOWS
        },
    }
    for key in ("changed_frac", "overlap", "load_imbalance"):
        summary[key] = _layer_mean(run, kind, key, records)
    summary["zero_reason"] = zero_panel_reason(run, kind)
    return summary


def zero_panel_reason(run: RunData, kind: str) -> str | None:
    """Why every record of ``kind`` is exactly zero, from the run's config; None if some record is not."""
    records = run.routing_records(kind)
    if (
        kind != DiagnosticKind.rollout_vs_train
        or not records
        or any(r.get("changed_frac_overall") != 0.0 for r in records)
    ):
        return None
    routing, rollout, model = (run.config.get(key) or {} for key in ("routing", "rollout", "model"))
    if routing.get("replay") == ReplayMode.rollout:
        return "Zero by construction: R3 replays the engine's routing in every trainer forward."
    engine_dtype = (rollout.get("embedded") or {}).get("dtype")
    if (
        rollout.get("engine") == RolloutEngineName.embedded
        and engine_dtype is not None
        and engine_dtype == model.get("dtype")
    ):
        return (
            f"Zero as expected: the embedded engine computes in {engine_dtype}, as the trainer does, so both route "
            "every token to the same experts. An engine in another precision (rollout.embedded.dtype=bfloat16) or "
            "SGLang shows the engine-trainer routing mismatch here."
        )
    return "Every record is exactly zero: the engine and the trainer routed every token to the same experts."


def summarize_run(run: RunData) -> dict:
    """Final reward, clip fractions and per-kind routing volatility of one run."""
    _, rewards = run.metric_series(REWARD_KEY)
    _, clip_token = run.metric_series(CLIP_FRAC_TOKEN_KEY)
    _, clip_seq = run.metric_series(CLIP_FRAC_SEQ_KEY)
    steps = [r["step"] for r in run.metrics if "step" in r]
    summary = {
        "label": run.label,
        "run_dir": str(run.path),
        "steps": len(run.metrics),
        "last_step": max(steps) if steps else None,
        "final_reward": rewards[-1] if rewards else None,
        "mean_reward": finite_mean(rewards),
        "clip_frac_token_mean": finite_mean(clip_token),
        "clip_frac_token_final": clip_token[-1] if clip_token else None,
        "clip_frac_seq_mean": finite_mean(clip_seq),
        "clip_frac_seq_final": clip_seq[-1] if clip_seq else None,
        "windows": {
            window: {key: window_mean(run.metric_series(key)[1], window) for key in WINDOWED_METRICS}
            for window in WINDOWS
        },
        "routing": {kind: routing_kind_summary(run, kind) for kind in ordered_kinds(run.routing_kinds())},
    }
    per_turn = routing_turn_summary(run)
    if per_turn:
        summary["routing_per_turn"] = per_turn
    return json_safe(summary)


TURN_RATIO_KEYS = ("token_var_share_routing", "token_var_share_weight", "token_changed_frac")


def routing_turn_summary(run: RunData) -> dict:
    """Multi-turn runs: per diagnostic kind and turn, the step means of the volatility over the positions that
    turn fed, and per turn the ratio decomposition's step means (``policy/routing/diagnostics.py``). Empty for a
    single-turn run."""
    out: dict[str, Any] = {}
    for kind in ordered_kinds(run.routing_kinds()):
        turns = run.routing_turn_records(kind)
        if turns:
            out[kind] = {
                str(turn): {
                    "records": len(records),
                    "tokens": sum(int(r.get("tokens", 0)) for r in records),
                    "changed_frac_overall": finite_mean([r.get("changed_frac_overall") for r in records]),
                    "changed_any_frac": finite_mean([r.get("changed_any_frac") for r in records]),
                    "changed_frac": _layer_mean(run, kind, "changed_frac", records),
                }
                for turn, records in turns.items()
            }
    ratio: dict[str, dict] = {}
    for key in sorted({k for r in run.metrics for k in r if k.startswith("ratio_decomp/turn_")}):
        turn, name = key.removeprefix("ratio_decomp/turn_").split("/", 1)
        if name in TURN_RATIO_KEYS:
            ratio.setdefault(turn, {})[name] = finite_mean(run.metric_series(key)[1])
    if ratio:
        out["ratio_decomposition"] = dict(sorted(ratio.items(), key=lambda item: int(item[0])))
    return out


def ordered_kinds(kinds: Iterable[str]) -> list[str]:
    """Known kinds in their canonical order, then any others (from newer trainers) alphabetically."""
    kinds = set(kinds)
    return [k for k in DIAGNOSTIC_KINDS if k in kinds] + sorted(kinds - set(DIAGNOSTIC_KINDS))


# ---- HTML helpers (shared with tools/compare_runs.py) ----


def png_img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def format_number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def html_table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(format_number(cell))}</td>" for cell in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_page(title: str, sections: list[tuple[str, str, str]]) -> str:
    """A standalone page; ``sections`` are (id, heading, inner html)."""
    style = (
        "body{font-family:sans-serif;margin:2em;max-width:1200px}"
        "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "th{background:#eee}img{max-width:100%}"
    )
    parts = [
        f'<section id="{sid}"><h2>{html.escape(heading)}</h2>{inner}</section>' for sid, heading, inner in sections
    ]
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{''.join(parts)}</body></html>\n"
    )


def training_panels(runs: list[RunData]) -> list[Panel]:
    """Reward and clip-fraction panels, one line per run (token solid, sequence dashed)."""
    reward = Panel("reward", REWARD_KEY)
    clip = Panel("clip fraction (token solid, sequence dashed)", "fraction clipped")
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        reward.series.append(Series(run.label, *run.metric_series(REWARD_KEY), color=color))
        clip.series.append(Series(f"{run.label} token", *run.metric_series(CLIP_FRAC_TOKEN_KEY), color=color))
        clip.series.append(Series(f"{run.label} seq", *run.metric_series(CLIP_FRAC_SEQ_KEY), "--", color=color))
    return [reward, clip]


# ---- one run's report ----


def _summary_section(summary: dict) -> str:
    rows = [
        [key, summary[key]]
        for key in (
            "steps",
            "last_step",
            "final_reward",
            "mean_reward",
            "clip_frac_token_mean",
            "clip_frac_token_final",
            "clip_frac_seq_mean",
            "clip_frac_seq_final",
        )
    ]
    for window, values in summary["windows"].items():
        rows += [[f"{name}, {window}", values[key]] for key, name in WINDOWED_METRICS.items()]
    for kind, kind_summary in summary["routing"].items():
        for window, value in kind_summary["changed_frac_overall_windows"].items():
            rows.append([f"{kind}: expert sets changed, {window}", value])
        rows.append([f"{kind}: experts changed per slot (step mean)", kind_summary["experts_changed_per_slot"]])
        rows.append([f"{kind}: overlap (step mean)", kind_summary["overlap_overall"]])
        rows.append([f"{kind}: tokens changed in >= 1 layer (step mean)", kind_summary["changed_any_frac"]])
    return html_table(["quantity", "value"], rows)


NOT_DRAWN = (
    "<p>Chart not drawn (<code>logging.charts=false</code>): "
    "<code>python -m gspo_megatron.run.routing_report RUN_DIR</code> draws it.</p>"
)


def chart(draw: Callable[[], Figure], alt: str, charts: bool) -> str:
    """``draw()``'s figure as an inline PNG, or, without charts, the note that says how to draw it."""
    return png_img(figure_png(draw()), alt) if charts else NOT_DRAWN


def _routed_layers(run: RunData) -> tuple[list[int] | None, str]:
    """The model layers the per-layer series are of (MoE layers only), and a note on what is not routed:
    dense layers (no router) and a shared expert (every token, no choice). (None, "") without a config."""
    model = run.config.get("model")
    if not isinstance(model, dict):
        return None, ""
    layers = model.get("num_layers")
    if not isinstance(layers, int):
        return None, ""
    dense = sorted(model.get("dense_layers") or [])
    notes = [f"dense layers {dense} have no router" if dense else ""]
    if model.get("shared_expert_intermediate_size"):
        notes.append("the shared expert runs for every token, unrouted")
    note = "; ".join(n for n in notes if n)
    return [i for i in range(layers) if i not in set(dense)], (f"<p>Not in the tables: {note}.</p>" if note else "")


def _volatility_section(run: RunData, summary: dict, charts: bool) -> str:
    if not summary["routing"]:
        return "<p>No routing diagnostics recorded (no routing.jsonl records).</p>"
    moe_layers, note = _routed_layers(run)
    parts = [note]
    for kind, kind_summary in summary["routing"].items():
        parts.append(f"<h3>{html.escape(kind)}</h3>")
        if kind_summary.get("zero_reason"):
            parts.append(f"<p><b>{html.escape(kind_summary['zero_reason'])}</b></p>")
        draw = functools.partial(volatility_figure, kind, run.routing_records(kind))
        parts.append(chart(draw, f"volatility {kind}", charts))
        changed, overlap = kind_summary["changed_frac"] or [], kind_summary["overlap"] or []
        # strict=False: either series may be absent from the summary
        pairs = list(zip(changed, overlap, strict=False))
        # the model's own layer numbers where the config says which layers are routed
        names = moe_layers if moe_layers is not None and len(moe_layers) == len(pairs) else range(len(pairs))
        rows = [[layer, c, o] for layer, (c, o) in zip(names, pairs, strict=True)]
        parts.append(html_table(["layer", "changed fraction (step mean)", "overlap (step mean)"], rows))
    return "".join(parts)


def _turn_section(summary: dict) -> str:
    """Multi-turn runs: where in a trajectory the routing moves (the per-turn summary as tables)."""
    per_turn = summary.get("routing_per_turn")
    if not per_turn:
        return "<p>Single-turn samples: no per-turn diagnostics.</p>"
    parts = [
        "<p>Each turn's numbers cover the positions its engine call fed: the prompt or the inserted tokens and "
        "the last generated token before them (its prefill), then its own generated tokens (decoding).</p>"
    ]
    rows = [
        [
            kind,
            int(turn),
            t["tokens"],
            t["changed_frac_overall"],
            t["changed_any_frac"],
            " ".join(format_number(v, 3) for v in t["changed_frac"] or []),
        ]
        for kind, turns in per_turn.items()
        if kind != "ratio_decomposition"
        for turn, t in turns.items()
    ]
    headers = ["kind", "turn", "tokens (all steps)", "changed fraction", "changed in >= 1 layer", "per layer"]
    parts.append(html_table(headers, rows))
    ratio = per_turn.get("ratio_decomposition")
    if ratio:
        parts.append(
            "<p>The importance ratio of the tokens each turn generated, split into its routing and weight "
            "parts (step means):</p>"
        )
        rows = [[int(turn), *(values.get(key) for key in TURN_RATIO_KEYS)] for turn, values in ratio.items()]
        parts.append(html_table(["turn", *TURN_RATIO_KEYS], rows))
    return "".join(parts)


def _expert_load_section(run: RunData, charts: bool) -> str:
    with_load = [r for r in run.routing if "expert_load" in r]
    if not with_load:
        return "<p>No expert-load records.</p>"
    last = max(with_load, key=lambda r: r.get("step", 0))
    return chart(functools.partial(expert_load_figure, last), "expert load heatmap", charts)


def write_routing_report(run_dir: str | os.PathLike, charts: bool = True) -> tuple[Path, Path]:
    """Write ``routing_report.json`` and ``routing_report.html`` into ``run_dir``; returns both paths.
    ``charts=False``: the page without its figures (the numbers are the same)."""
    run = load_run(run_dir)
    summary = summarize_run(run)
    json_path, html_path = run.path / REPORT_JSON, run.path / REPORT_HTML
    write_run_file(json_path, json.dumps(summary, indent=2) + "\n")
    curves = chart(functools.partial(line_panels, training_panels([run])), "reward and clip fraction", charts)
    page = html_page(
        f"Routing report: {run.label}",
        [
            ("summary", "Summary", _summary_section(summary)),
            ("volatility", "Routing volatility", _volatility_section(run, summary, charts)),
            ("per-turn", "Per turn (multi-turn trajectories)", _turn_section(summary)),
            ("expert-load", "Expert load (last step)", _expert_load_section(run, charts)),
            ("training-curves", "Reward and clip fraction", curves),
        ],
    )
    write_run_file(html_path, page)
    return json_path, html_path


def main(argv: list[str] | None = None) -> int:
    """``python -m gspo_megatron.run.routing_report RUN_DIR``: (re)write the report of a run directory."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m gspo_megatron.run.routing_report", description=main.__doc__)
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    try:
        json_path, html_path = write_routing_report(args.run_dir)
    except RunDirError as err:
        print(f"routing report: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {json_path} and {html_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
