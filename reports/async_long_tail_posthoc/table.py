"""The post hoc diagnostics' numbers (reports/async_long_tail/README.md, "Post hoc"), from this directory's store.

    python3 reports/async_long_tail_posthoc/table.py

Runs a*, b*, c*: seed 2, 20 steps (the arms in each run's name: k, correction, lr). Per run: mean reward/mean over
steps 1-20, 6-10 (the stored k = 2 run's dip) and 16-20, its lowest step, and the means over steps 2-20 of the
behaviour -> trainer gap |log pi_old - log mu| per token, KL(pi_old || pi_theta) k3 in the update, the sequence clip
fraction, the decoupled weight's mean and masked fraction, and the trained tokens' age.
Runs d*: lr 1e-30 (frozen weights), 8 steps: the metrics, time/ and async/ left out, in which k = 1 and k = 2 differ
from sync (d0).
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "stored_runs"


def records(name: str) -> list[dict]:
    with gzip.open(RUNS / name / "metrics.jsonl.gz", "rt") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def mean_over(run: list[dict], key: str, first: int, last: int) -> float:
    """Mean of ``key`` over steps first..last (1-based, inclusive); NaN where the run never logs it."""
    values = [m[key] for m in run if first <= m["step"] <= last and key in m]
    return statistics.mean(values) if values else float("nan")


def learning_row(name: str) -> str:
    run = records(name)
    rewards = [m["reward/mean"] for m in run]
    low = min(rewards)
    gaps = [
        ("dlogp", "mismatch/abs_log_prob_diff_mean"),
        ("kl3", "loss/approx_kl_k3"),
        ("clip_seq", "loss/clip_frac_seq"),
        ("w_mean", "mismatch_is/weight_mean"),
        ("masked", "mismatch_is/masked_frac"),
        ("age", "async/staleness_mean"),
    ]
    return (
        f"| {name} | {mean_over(run, 'reward/mean', 1, 20):.4f} | {mean_over(run, 'reward/mean', 6, 10):.4f} | "
        f"{mean_over(run, 'reward/mean', 16, 20):.4f} | {low:.3f} (step {rewards.index(low) + 1}) | "
        + " | ".join(f"{mean_over(run, key, 2, 20):.4f}" for _, key in gaps)
        + " |"
    )


def differing_keys(reference: list[dict], other: list[dict]) -> list[tuple[int, str]]:
    """(step, key) where ``other`` differs from ``reference``, time/ and async/ left out."""
    return [
        (a["step"], key)
        for a, b in zip(reference, other, strict=True)
        for key, value in a.items()
        if not key.startswith(("time/", "async/")) and b.get(key) != value
    ]


def main() -> None:
    names = sorted(p.name for p in RUNS.iterdir())
    print("| run | R 1-20 | R 6-10 | R 16-20 | lowest R | dlogp | kl3 | clip_seq | w_mean | masked | age |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        if not name.startswith("d"):
            print(learning_row(name))
    frozen = [name for name in names if name.startswith("d")]
    sync = records(frozen[0])
    compared = sum(1 for m in sync for key in m if not key.startswith(("time/", "async/")))
    for name in frozen[1:]:
        run = records(name)
        ages = [m["async/staleness_max"] for m in run]
        print(f"{name}: ages {ages}; {len(differing_keys(sync, run))} of {compared} values differ from {frozen[0]}")


if __name__ == "__main__":
    main()
