"""Matplotlib figures for the routing report and the run comparison, rendered to PNG bytes.

Design decisions:
- Figures are built as ``matplotlib.figure.Figure`` objects drawn by the Agg canvas directly, never
  through ``pyplot``: no global figure registry, no backend switch at import time, nothing to leak
  into the trainer or into tests, and it works on a headless node.
- Every plot takes plain data (steps, values, nested lists from run-directory records), so the
  same functions serve one run's report and the side-by-side comparison.
- Line charts are described as ``Panel``s of ``Series``; one function lays out any number of panels.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


@dataclass
class Series:
    label: str
    steps: list[int]
    values: list[float]
    linestyle: str = "-"
    color: str | None = None
    band: tuple[list[float], list[float]] | None = None  # (lower, upper) per step: a seed spread


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    xlabel: str = "step"


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """Render a figure to PNG bytes with the Agg canvas."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def line_panels(panels: list[Panel], columns: int = 2) -> Figure:
    """One subplot per panel, one line per series; empty panels say 'no data' instead of vanishing."""
    if not panels:
        raise ValueError("line_panels needs at least one panel")
    columns = min(columns, len(panels))
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(5.5 * columns, 3.6 * rows))
    for index, panel in enumerate(panels):
        ax = fig.add_subplot(rows, columns, index + 1)
        drawn = False
        for series in panel.series:
            if series.steps:
                # markers keep single-step (or sparse) series visible; dense curves stay plain lines
                marker = "o" if len(series.steps) <= 60 else None
                ax.plot(
                    series.steps,
                    series.values,
                    series.linestyle,
                    color=series.color,
                    label=series.label,
                    marker=marker,
                    markersize=3,
                )
                if series.band is not None:
                    ax.fill_between(series.steps, *series.band, color=ax.lines[-1].get_color(), alpha=0.2)
                drawn = True
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(panel.title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def volatility_figure(kind: str, records: list[dict]) -> Figure:
    """Top: overall changed fraction and 1 - overlap per step; bottom: changed fraction, layer x step."""
    records = [r for r in records if "changed_frac" in r]
    steps = [r["step"] for r in records]
    fig = Figure(figsize=(9, 6.5))
    top = fig.add_subplot(2, 1, 1)
    top.plot(steps, [r["changed_frac_overall"] for r in records], "-o", markersize=3, label="expert set changed")
    top.plot(steps, [1 - r["overlap_overall"] for r in records], "--", label="1 - overlap |A cap B|/k")
    top.set_title(f"routing volatility ({kind}), all layers")
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_xlabel("step")
    top.set_ylabel("fraction of tokens")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom = fig.add_subplot(2, 1, 2)
    if records:
        per_layer = np.array([r["changed_frac"] for r in records], dtype=float).T  # [L, steps]
        image = bottom.imshow(per_layer, aspect="auto", origin="lower", interpolation="nearest", cmap="viridis")
        ticks = np.linspace(0, len(steps) - 1, num=min(len(steps), 8)).round().astype(int)
        bottom.set_xticks(ticks, [str(steps[i]) for i in ticks])
        fig.colorbar(image, ax=bottom, label="changed fraction")
    bottom.set_title(f"changed fraction per layer ({kind})")
    bottom.set_xlabel("step")
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("layer")
    fig.tight_layout()
    return fig


def expert_load_figure(record: dict) -> Figure:
    """Heatmap of one record's expert-load fractions [L x E]; the colour scale is centred on 1/E."""
    load = np.array(record["expert_load"], dtype=float)
    num_experts = load.shape[1]
    fig = Figure(figsize=(min(4 + 0.12 * num_experts, 16), min(2.5 + 0.18 * load.shape[0], 12)))
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(
        load * num_experts,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        cmap="coolwarm",
        vmin=0.0,
        vmax=max(2.0, float(load.max() * num_experts)),
    )
    fig.colorbar(image, ax=ax, label="load x E (1 = balanced)")
    ax.set_title(f"expert load at step {record['step']} ({record['kind']})")
    ax.set_xlabel("expert")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("layer")
    fig.tight_layout()
    return fig
