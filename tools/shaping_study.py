"""The shaping study in one command: warm start, 3 arms x N seeds, report.

    python tools/shaping_study.py --out reports/shaping_study

1. Warm-starts the tiny MoE to long, verbose reasoning (``tools/sft_warmstart.py``: 2-5 digit
   problems, 0-5 useless "Wait" re-checks, so keyword segments fall in all three length clusters of
   ``conf/experiment/shaping_from_sft.yaml``), unless ``--checkpoint`` already exists.
2. Trains every arm from it with ``+experiment=shaping_from_sft`` for each seed:
   ``baseline`` (plain GSPO), ``step_grpo_dtr`` (Step-GRPO reward + Dynamic Truncated Rollout: the
   whole method), ``grsp`` (GRSP segment penalty). A finished run (its metrics.jsonl has the last
   step) is reused, so an interrupted study resumes.
3. Writes ``OUT/report.md`` and ``OUT/report.json`` (``gspo_megatron.shaping.report``): per arm, seed
   mean ± sample std of rollout tokens, keyword steps, segments per length cluster, accuracy, DTR
   exits, and the last evaluation; the change vs baseline beside the papers' claims.

Runs go to ``OUT/runs/<arm>_s<seed>`` (their metrics.jsonl copied to ``OUT/metrics/``, logs beside);
extra Hydra overrides after ``--`` apply to every arm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARMS = {
    "baseline": ["shaping=none"],
    "step_grpo_dtr": ["shaping=step_grpo", "rollout.truncated=true"],
    "grsp": ["shaping=grsp"],
}
WARM_START = ["--digits", "5", "--min-digits", "2", "--max-waits", "5"]


def _run(cmd: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"command failed ({done.returncode}), see {log}: {' '.join(cmd)}")


def _finished(run_dir: Path, steps: int) -> bool:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return False
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return any(m.get("step") == steps for m in lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="reports/shaping_study")
    parser.add_argument("--checkpoint", default="checkpoints/tiny_long_reasoner")
    parser.add_argument("--warm-start-steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run (trainer.steps)")
    parser.add_argument("--last-steps", type=int, default=10, help="training steps averaged per run")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every arm")
    args = parser.parse_args(argv)

    from gspo_megatron.shaping.report import (
        aggregate,
        read_metrics,
        relative_to_baseline,
        render_markdown,
        summarize_run,
    )

    out = (REPO / args.out).resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    checkpoint = (REPO / args.checkpoint).resolve()
    if not (checkpoint / "config.json").is_file():
        print(f"warm start -> {checkpoint}", flush=True)
        _run(
            [
                sys.executable,
                "tools/sft_warmstart.py",
                "--out",
                str(checkpoint),
                "--steps",
                str(args.warm_start_steps),
                *WARM_START,
            ],
            out / "warm_start.log",
        )
    arms: dict[str, list[dict]] = {}
    for arm in args.arms:
        for seed in args.seeds:
            run_dir = out / "runs" / f"{arm}_s{seed}"
            if not _finished(run_dir, args.steps):
                print(f"train {arm} seed {seed} -> {run_dir}", flush=True)
                _run(
                    [
                        sys.executable,
                        "-m",
                        "gspo_megatron.train",
                        "+experiment=shaping_from_sft",
                        f"model.hf_checkpoint={checkpoint}",
                        f"trainer.seed={seed}",
                        f"trainer.steps={args.steps}",
                        f"run_dir={run_dir}",
                        *ARMS[arm],
                        *args.overrides,
                    ],
                    out / f"{arm}_s{seed}.log",
                )
            metrics = read_metrics(run_dir)
            (out / "metrics").mkdir(exist_ok=True)  # the runs' step logs, kept beside the report
            shutil.copyfile(run_dir / "metrics.jsonl", out / "metrics" / f"{arm}_s{seed}.jsonl")
            arms.setdefault(arm, []).append(summarize_run(metrics, args.last_steps))
    stats = {arm: aggregate(runs) for arm, runs in arms.items()}
    relative = relative_to_baseline(stats)
    notes = [
        f"command: python tools/shaping_study.py --out {args.out} --steps {args.steps} --seeds "
        f"{' '.join(map(str, args.seeds))} --warm-start-steps {args.warm_start_steps} -- "
        f"{' '.join(args.overrides)}".rstrip(" -"),
        f"warm start: tools/sft_warmstart.py --steps {args.warm_start_steps} {' '.join(WARM_START)}",
        f"per run: mean over its last {args.last_steps} training steps; eval_* = its last evaluation "
        "(held-out prompts, plain decoding); ± is the sample std over seeds",
        "arms: " + "; ".join(f"{a}: {' '.join(ARMS[a])}" for a in arms),
    ]
    (out / "report.json").write_text(
        json.dumps({"arms": stats, "relative": relative, "notes": notes, "runs": arms}, indent=2)
    )
    report = render_markdown(stats, relative, notes)
    (out / "report.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
