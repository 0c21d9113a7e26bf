"""The learning comparison of rollout schedules from its stored runs (reports/async_long_tail/: README.md).

    python -m gspo_megatron.train --multirun +experiment=async_long_tail model.hf_checkpoint=CKPT \
        hydra.sweep.dir=multirun/async_long_tail
    python3 tools/store_runs.py multirun/async_long_tail --study reports/async_long_tail --report async_study
    python3 tools/regenerate_report.py reports/async_long_tail            # writes report.json, report.md, the figure

Per arm -- named from each run's config (``arm_of``: ``sync``, ``stream_k<k>``, with ``_<engine>`` when the
engine is not the embedded one, so an SGLang sweep stored beside the embedded one is an arm of its own) -- and
per seed: the criterion's R (the mean ``reward/mean`` of the last ``LAST_STEPS`` steps), the reward vs steps and
vs wall time (``time/run_wall_s``), the trained tokens by age, both idle fractions and the trained tokens per
second; then the band around ``sync`` and each other arm's verdict against it.

Design decisions:
- The criterion is the README's, written before the runs: band = mean_sync(R) +- max(``SPREAD_TIMES`` x the
  sample std (n - 1) of sync's R, ``BAND_FLOOR``); an arm trains to the same band when the mean of its R lies
  inside. Each seed's R against the band is reported beside it, not part of the verdict.
- Idle fractions, tokens by age and tokens / s are ``tools/bench_async.py``'s (``step_samples``: the streaming
  scheduler's own per-step fractions; sync's derived from ``time/generation`` and its overlap), cycle-weighted
  over every step after the first (the first step's cycle is the run's start-up), pooled over seeds.
- Means by ``math.fsum`` and ``statistics.stdev`` (exact): the report regenerates bit for bit on Python 3.11 and
  3.12 alike (3.12's ``sum`` of floats compensates, 3.11's does not).
- Curves: the step-wise mean over seeds of ``reward/mean`` and of ``time/run_wall_s`` (every run of the study
  has the same steps); reward vs wall time is the one plotted against the other.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

from bench_async import MAX_AGE, StepSample, step_samples

from gspo_megatron.core.config_node import flatten_dotted

if TYPE_CHECKING:
    from gspo_megatron.core.run_dir import RunData
    from study_reports.store import StoredStudy

BASELINE = "sync"
LAST_STEPS = 20  # R: the mean reward of a run's last 20 steps (README)
SPREAD_TIMES = 2.0  # the band's half width: max(2 x sync's seed std, the floor)
BAND_FLOOR = 0.03
MEASURE_FROM_STEP = 2  # idle fractions and ages: the steps after the first (bench_async's warmup = 1)
REWARD_KEY, WALL_KEY = "reward/mean", "time/run_wall_s"


def arm_of(config: dict) -> str:
    """The arm a run belongs to, from its composed config: the schedule, and the engine unless embedded."""
    flat = flatten_dotted(config)
    k = int(flat["rollout.max_staleness"]) if flat["rollout.async_rollout"] else 0
    schedule = BASELINE if k == 0 else f"stream_k{k}"
    engine = flat["rollout.engine"]
    return schedule if engine == "embedded" else f"{schedule}_{engine}"


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def run_summary(records: list[dict]) -> dict:
    """One run: its R, its last step's wall time and its number of steps."""
    if len(records) < LAST_STEPS:
        raise ValueError(f"a run of {len(records)} steps has no last {LAST_STEPS} steps (README: the criterion)")
    return {
        "steps": len(records),
        "reward_last": mean([r[REWARD_KEY] for r in records[-LAST_STEPS:]]),
        "wall_s": records[-1][WALL_KEY],
    }


def pooled_timings(samples: list[StepSample]) -> dict:
    """Cycle-weighted idle fractions, trained tokens by age and per second, over the measured steps."""
    cycle = math.fsum(s.cycle_s for s in samples)
    tokens = math.fsum(s.trained_tokens for s in samples)
    return {
        "measured_steps": len(samples),
        "trainer_idle_frac": math.fsum(s.trainer_idle_s for s in samples) / cycle,
        "engine_idle_frac": math.fsum(s.engine_idle_s for s in samples) / cycle,
        "tokens_by_age_frac": [math.fsum(s.tokens_by_age[a] for s in samples) / tokens for a in range(MAX_AGE + 1)],
        "trained_tokens_per_s": tokens / cycle,
    }


def curve(runs: list[list[dict]]) -> dict:
    """The step-wise mean over seeds of the reward and of the wall time."""
    steps = min(len(records) for records in runs)
    return {
        "step": [runs[0][i]["step"] for i in range(steps)],
        "reward_mean": [mean([records[i][REWARD_KEY] for records in runs]) for i in range(steps)],
        "wall_s_mean": [mean([records[i][WALL_KEY] for records in runs]) for i in range(steps)],
    }


def arm_summary(arm: str, runs: dict[str, list[dict]]) -> dict:
    """One arm over its seeds (``runs``: seed -> metrics records in step order)."""
    seeds = {seed: run_summary(records) for seed, records in sorted(runs.items())}
    rewards = [s["reward_last"] for s in seeds.values()]
    samples = [sample for records in runs.values() for sample in step_samples(arm, records, MEASURE_FROM_STEP - 1)]
    return {
        "seeds": seeds,
        "reward_last_mean": mean(rewards),
        "reward_last_std": statistics.stdev(rewards) if len(rewards) > 1 else None,
        "wall_s_mean": mean([s["wall_s"] for s in seeds.values()]),
        **pooled_timings(samples),
        "curve": curve(list(runs.values())),
    }


def band_of(baseline: dict) -> dict:
    """The README's band around the baseline arm's mean R."""
    spread = baseline["reward_last_std"]
    if spread is None:
        raise ValueError(f"the {BASELINE} arm has one seed: the band needs its seeds' spread (README: 3 seeds)")
    half_width = max(SPREAD_TIMES * spread, BAND_FLOOR)
    center = baseline["reward_last_mean"]
    return {"center": center, "half_width": half_width, "low": center - half_width, "high": center + half_width}


def verdict(arm: dict, band: dict, baseline: dict) -> dict:
    inside = band["low"] <= arm["reward_last_mean"] <= band["high"]
    return {
        "reward_last_mean": arm["reward_last_mean"],
        "difference_to_sync": arm["reward_last_mean"] - band["center"],
        "same_band": inside,
        "seeds_inside_band": sum(band["low"] <= s["reward_last"] <= band["high"] for s in arm["seeds"].values()),
        "wall_s_ratio_to_sync": arm["wall_s_mean"] / baseline["wall_s_mean"],
        "tokens_per_s_ratio_to_sync": arm["trained_tokens_per_s"] / baseline["trained_tokens_per_s"],
    }


def report_of(runs: list[RunData], manifests: dict) -> dict:
    """``report.json``'s document from the stored runs (their configs and metrics) and manifests."""
    by_arm: dict[str, dict[str, list[dict]]] = {}
    for run in runs:
        seed = str(flatten_dotted(run.config)["trainer.seed"])
        by_arm.setdefault(arm_of(run.config), {})[seed] = run.metrics
    if BASELINE not in by_arm:
        raise ValueError(f"no {BASELINE} run among the stored arms {sorted(by_arm)}: the band is sync's")
    arms = {arm: arm_summary(arm, seeds) for arm, seeds in sorted(by_arm.items())}
    band = band_of(arms[BASELINE])
    return {
        "criterion": {
            "last_steps": LAST_STEPS,
            "spread_times": SPREAD_TIMES,
            "band_floor": BAND_FLOOR,
            "baseline": BASELINE,
            "rule": "arm mean of R inside sync's mean of R +- max(2 x sync's sample std of R, 0.03)",
        },
        "band": band,
        "verdicts": {arm: verdict(summary, band, arms[BASELINE]) for arm, summary in arms.items() if arm != BASELINE},
        "arms": arms,
        "runs": {
            name: {
                "commit": m.commit,
                "clean_tree": m.clean_tree,
                "cpu_threads": m.cpu_threads,
                "warm_start_sha256": m.warm_start_sha256,
            }
            for name, m in sorted(manifests.items())
        },
    }


def markdown_of(report: dict) -> str:
    """``report.md``: the verdict, the per-seed R, and the timing table."""
    band = report["band"]
    lines = [
        "# Learning comparison: rollout schedules (written by tools/regenerate_report.py from the store)",
        "",
        f"Band (README): sync's mean R {band['center']:.4f} +- {band['half_width']:.4f} = "
        f"[{band['low']:.4f}, {band['high']:.4f}]; R = mean reward/mean of the last {LAST_STEPS} steps.",
        "",
        "| arm | R by seed | mean R | std | vs sync | same band | seeds inside | wall s (mean) | wall x sync |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, summary in report["arms"].items():
        seeds = ", ".join(f"{seed}: {s['reward_last']:.4f}" for seed, s in summary["seeds"].items())
        judged = report["verdicts"].get(arm)
        std = summary["reward_last_std"]
        lines.append(
            f"| {arm} | {seeds} | {summary['reward_last_mean']:.4f} | {'-' if std is None else f'{std:.4f}'} | "
            + (
                f"{judged['difference_to_sync']:+.4f} | {'yes' if judged['same_band'] else 'NO'} | "
                f"{judged['seeds_inside_band']}/{len(summary['seeds'])} | {summary['wall_s_mean']:.1f} | "
                f"{judged['wall_s_ratio_to_sync']:.2f}x |"
                if judged
                else f"- | (the band) | - | {summary['wall_s_mean']:.1f} | 1.00x |"
            )
        )
    ages = " | ".join(f"age {a}" for a in range(MAX_AGE + 1))
    lines += [
        "",
        f"Steps {MEASURE_FROM_STEP}-last of every seed, pooled (cycle-weighted; tools/bench_async.py's definitions):",
        "",
        f"| arm | steps | trained tokens/s | trainer idle | engine idle | {ages} |",
        "|---|---|---|---|---|" + "---|" * (MAX_AGE + 1),
    ]
    for arm, s in report["arms"].items():
        fractions = " | ".join(f"{f:.3f}" for f in s["tokens_by_age_frac"])
        lines.append(
            f"| {arm} | {s['measured_steps']} | {s['trained_tokens_per_s']:.1f} | {s['trainer_idle_frac']:.3f} | "
            f"{s['engine_idle_frac']:.3f} | {fractions} |"
        )
    return "\n".join(lines) + "\n"


def write_figure(report: dict, path: Path) -> None:
    """Reward vs steps and vs wall time per arm (the seeds' mean); nothing when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"async_report: matplotlib not installed: {path.name} not drawn", file=sys.stderr)
        return
    figure, (by_step, by_wall) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, summary in report["arms"].items():
        line = summary["curve"]
        by_step.plot(line["step"], line["reward_mean"], label=arm)
        by_wall.plot(line["wall_s_mean"], line["reward_mean"], label=arm)
    by_step.set(xlabel="step", ylabel="reward/mean (mean of seeds)")
    by_wall.set(xlabel="wall time, s (mean of seeds)")
    by_step.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def write_report(study: StoredStudy, out: Path) -> str:
    """``report.json``, ``report.md`` and ``reward_curves.png`` into ``out``; returns the markdown."""
    report = report_of(study.runs, study.manifests)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = markdown_of(report)
    (out / "report.md").write_text(markdown)
    write_figure(report, out / "reward_curves.png")
    return markdown
