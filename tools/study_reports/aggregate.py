"""Group run directories by configuration and aggregate their seeds: mean and spread of any metric.

    groups = group_runs(load_runs_from(["multirun/2026-11-23_20-00-00"]))
    for g in groups:
        stat = metric_stat(g, "reward/mean", reduce="final")   # Stat(mean, std, n, values)
        steps, mean, std = metric_curve(g, "reward/mean")      # seed band per step

Design decisions:
- Generic: nothing here knows about routing or algorithms. A group is the set of runs whose
  resolved ``config.yaml`` agree on every key except the seed keys (``trainer.seed`` by default) and
  bookkeeping (``run_dir``); its label names the keys that differ *between groups* (keys that only
  follow an earlier one, like ``algorithm.loss`` after ``algorithm.name``, are left out), so a sweep
  over ``algorithm`` x ``trainer.updates_per_rollout`` gets labels like ``grpo upr=4`` untold.
  Any metric key of ``metrics.jsonl`` (shaping, rewards, routing scalars) aggregates the same way.
- A sweep directory (Hydra's ``multirun/<date>``) is expanded into its run subdirectories; files in
  it or given on the command line (``multirun.yaml`` from a shell glob) are not runs and are skipped,
  and reported as skipped. A directory that is neither a run nor holds runs is an error.
- Spread is the sample standard deviation over seeds (0 for one seed); per-step curves average the
  runs that logged that step; a run without the key does not count (``n`` says how many did).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo_megatron.core.config_node import flatten_dotted
from gspo_megatron.core.run_dir import METRICS_FILE, WHOLE_RUN, WINDOWS, RunData, RunDirError, load_run, window_mean

DEFAULT_SEED_KEYS = ("trainer.seed",)
IGNORED_KEYS = ("run_dir",)
SHORT_NAMES = {"algorithm.name": "", "trainer.updates_per_rollout": "upr"}  # "" = value alone


@dataclass
class Stat:
    """Mean and sample standard deviation of one number over the runs (seeds) that have it."""

    mean: float | None
    std: float | None
    n: int
    values: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, values: Iterable[float | None], *, exact: bool = False) -> Stat:
        """``exact``: sums by ``math.fsum`` (exactly rounded), so the numbers are the same on every Python --
        3.12's ``sum()`` of floats compensates and 3.11's does not. The older reports keep ``sum()``: their
        stored numbers were computed with it."""
        finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not finite:
            return cls(None, None, 0, [])
        add = math.fsum if exact else sum
        mean = add(finite) / len(finite)
        var = add((v - mean) ** 2 for v in finite) / (len(finite) - 1) if len(finite) > 1 else 0.0
        return cls(mean, math.sqrt(var), len(finite), finite)

    def to_dict(self) -> dict:
        return {"mean": self.mean, "std": self.std, "n": self.n, "values": self.values}


@dataclass
class RunGroup:
    label: str
    settings: dict[str, Any]  # the group-defining config values (the keys that differ between groups)
    runs: list[RunData]


def expand_run_paths(paths: Iterable[str | Path]) -> tuple[list[Path], list[Path]]:
    """(run directories, skipped non-run entries). Sweep directories expand to their runs."""
    runs, skipped = [], []
    for path in map(Path, paths):
        if path.is_file():
            skipped.append(path)  # e.g. multirun/<date>/multirun.yaml matched by a shell glob
        elif path.is_dir() and not (path / METRICS_FILE).is_file():
            children = sorted(p for p in path.iterdir() if p.is_dir() and (p / METRICS_FILE).is_file())
            if children:
                runs.extend(children)
                skipped.extend(sorted(p for p in path.iterdir() if p not in children))
            else:
                runs.append(path)  # load_run names what is missing
        else:
            runs.append(path)
    return runs, skipped


def load_runs_from(paths: Iterable[str | Path]) -> list[RunData]:
    runs, _ = expand_run_paths(paths)
    if not runs:
        raise RunDirError("no run directories given")
    return [load_run(path) for path in runs]


def _short(key: str, value: Any) -> str:
    name = SHORT_NAMES.get(key, key.rsplit(".", 1)[-1])
    return f"{value}" if name == "" else f"{name}={value}"


def group_runs(
    runs: list[RunData], seed_keys: Iterable[str] = DEFAULT_SEED_KEYS, ignored: Iterable[str] = IGNORED_KEYS
) -> list[RunGroup]:
    """Runs that differ only in the seed keys form one group; groups keep the runs' order."""
    skip = set(seed_keys) | set(ignored)
    flat = [{k: v for k, v in flatten_dotted(run.config, hashable=True).items() if k not in skip} for run in runs]
    keys = sorted({k for f in flat for k in f})
    varying = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
    # the algorithm first, then the other swept keys in name order; a key that only follows an
    # earlier one (algorithm.loss follows algorithm.name) splits nothing further and is left out
    varying.sort(key=lambda k: (k != "algorithm.name", k))
    defining: list[str] = []
    for key in varying:
        before = {tuple(repr(f.get(k)) for k in defining) for f in flat}
        after = {tuple(repr(f.get(k)) for k in defining + [key]) for f in flat}
        if len(after) > len(before):
            defining.append(key)
    varying = defining
    groups: dict[tuple, RunGroup] = {}
    for run, values in zip(runs, flat, strict=True):
        settings = {k: values.get(k) for k in varying}
        ident = tuple(repr(settings[k]) for k in varying)
        if ident not in groups:
            label = " ".join(_short(k, v) for k, v in settings.items()) or run.label
            groups[ident] = RunGroup(label, settings, [])
        groups[ident].runs.append(run)
    return list(groups.values())


def per_run_stat(group: RunGroup, value_of: Callable[[RunData], float | None]) -> Stat:
    return Stat.of(value_of(run) for run in group.runs)


def run_metric(run: RunData, key: str, reduce: str = "mean") -> float | None:
    """One run's number for ``key``: the mean over its steps, the final value, the max, or the mean over one of
    the run summary's windows (``core/run_dir.py``'s ``WINDOWS``: "first 20%", "last 20%", "whole run")."""
    _, values = run.metric_series(key)
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    if reduce == "mean":
        return sum(values) / len(values)
    if reduce == "final":
        return values[-1]
    if reduce == "max":
        return max(values)
    if reduce in WINDOWS:
        return window_mean(values, reduce)
    raise ValueError(f"reduce must be mean, final, max or one of {', '.join(WINDOWS)}, got {reduce!r}")


def metric_stat(group: RunGroup, key: str, reduce: str = "mean") -> Stat:
    """Over seeds: each run reduced over its steps first (``run_metric``)."""
    return per_run_stat(group, lambda run: run_metric(run, key, reduce))


def metric_curve(group: RunGroup, key: str) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean over seeds, std over seeds) of a per-step metric."""
    by_step: dict[int, list[float]] = {}
    for run in group.runs:
        for step, value in zip(*run.metric_series(key), strict=True):
            if math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    stats = [Stat.of(by_step[s]) for s in steps]
    # every step has >= 1 finite value, so mean and std are set
    return steps, [float(s.mean or 0.0) for s in stats], [float(s.std or 0.0) for s in stats]


def routing_stat(group: RunGroup, kind: str, key: str = "changed_frac_overall", window: str = WHOLE_RUN) -> Stat:
    """Over seeds: each run's step mean of a scalar routing.jsonl field of one diagnostic kind, over ``window``
    of the steps that recorded it."""

    def value(run: RunData) -> float | None:
        return window_mean([r.get(key) for r in run.routing_records(kind)], window)

    return per_run_stat(group, value)


def routing_layer_means(group: RunGroup, kind: str, key: str = "changed_frac") -> list[float | None] | None:
    """Per layer: the mean over seeds of each run's step mean (None when no run recorded ``kind``)."""
    per_run = []
    for run in group.runs:
        rows = [r[key] for r in run.routing_records(kind) if key in r]
        if rows:
            per_run.append([Stat.of(column).mean for column in zip(*rows, strict=True)])
    if not per_run:
        return None
    return [Stat.of(column).mean for column in zip(*per_run, strict=True)]
