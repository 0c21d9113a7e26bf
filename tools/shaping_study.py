"""The shaping study in one command: warm start, 7 arms x N seeds, the warm start evaluated, report.

    python tools/shaping_study.py --out reports/shaping_study            # >= 50 RL steps, 3 seeds
    python tools/shaping_study.py --quick --out /tmp/shaping_quick        # 10 steps, 2 seeds: a smoke run

1. Warm-starts the tiny MoE to long, verbose reasoning (``tools/sft_warmstart.py``: 2-5 digit
   problems, 0-5 useless "Wait" re-checks, so keyword segments fall in all three length clusters of
   ``conf/experiment/shaping_from_sft.yaml``). Deterministic at a fixed thread count (THREADS, pinned
   here): the same command writes the same weights; the report records the checkpoint's
   ``warm_start.json`` (commit, command, sha256). An existing ``--checkpoint`` is kept only when that
   record names this command, a clean checkout of this commit and this thread count
   (``sft_warmstart.py --keep-if-current``); otherwise it is rebuilt.
2. Evaluates that warm start as it is (the "vanilla model" the Step-GRPO paper compares against).
3. Calibrates GRSP's confidence segmentation on that warm start
   (``tools/calibrate_confidence_segmentation.py``, written to ``OUT/confidence_calibration.json``);
   the ``grsp_confidence`` arm uses the calibrated window and threshold.
4. Trains every arm from it with ``+experiment=shaping_from_sft`` for each seed (ARMS below: plain
   GSPO, DTR only, Step-GRPO's reward only, Step-GRPO + DTR, the same with the exit tokens trained on,
   GRSP keyword, GRSP confidence). A finished run (its metrics.jsonl has the last step) of the same
   clean commit is reused, so an interrupted study resumes; a run of other code is trained again.
5. Stores every run in the study store (``study_reports/store.py``: ``OUT/store.json`` with the warm
   start's evaluation and record, the calibration and the notes as its ``inputs``; ``OUT/stored_runs/``:
   each run's step log, config and manifest) and writes ``OUT/report.md`` and ``OUT/report.json`` from that
   store (``tools/regenerate_report.py``, ``study_reports.shaping_report.study_files``): per arm, seed
   mean ± sample std. Learned brevity is measured on EVALUATION responses (plain decoding, no
   truncation, >= 64 prompts); rollout-token savings (DTR cuts rollouts before any update) are reported
   separately. The report records the commit, the full command and the seeds; the store each run's
   composed config. ``python3 tools/regenerate_report.py OUT --check`` rebuilds it bit for bit.

Runs go to ``OUT/runs/<arm>_s<seed>`` (logs beside). The tracked outputs (store, report, calibration) are
written only after every run finished, so no run sees a checkout that the study itself made dirty. Extra
Hydra overrides after ``--`` apply to every arm.
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
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed
ARMS = {
    "baseline": ["shaping=none"],
    "dtr_only": ["shaping=none", "rollout.truncated=true"],
    "step_grpo_reward": ["shaping=step_grpo"],
    "step_grpo_dtr": ["shaping=step_grpo", "rollout.truncated=true"],
    # the same, with the exit decision trained on (the forced "</think>" is an action, not context):
    # does DTR then teach brevity that survives decoding without it?
    "step_grpo_dtr_exit_trained": [
        "shaping=step_grpo",
        "rollout.truncated=true",
        "rollout.truncation.train_on_exit_tokens=true",
    ],
    "grsp_keyword": ["shaping=grsp", "shaping.grsp.segmentation=keyword"],
    "grsp_confidence": ["shaping=grsp", "shaping.grsp.segmentation=confidence"],
}
QUICK = {"steps": 10, "seeds": [0, 1]}
# torch's CPU kernels reduce in an order that depends on the thread count, so the same command writes
# the same weights only at the same count (measured: tools/sft_warmstart.py, 20 steps, twice at 1 thread
# identical, at 2 threads different). The study pins it for every process it starts and for itself.
THREADS = 1
WARM_START = ["--digits", "5", "--min-digits", "2", "--max-waits", "5"]


def _run(cmd: list[str], log: Path) -> None:
    pythonpath = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": str(THREADS)}
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


def reusable_run(run_dir: Path, steps: int, version: dict) -> bool:
    """A finished run of this very (clean) code: its provenance.json names the current commit."""
    from gspo_megatron.core.provenance import same_clean_code

    path = run_dir / "provenance.json"
    return _finished(run_dir, steps) and path.is_file() and same_clean_code(json.loads(path.read_text()), version)


def evaluate_warm_start(checkpoint: Path, overrides: list[str]) -> dict[str, float]:
    """pass@1 and response length of the warm start itself, on the study's evaluation prompts and
    settings (the trainer's own evaluation: same prompts, sampling and verifier)."""
    from transformers import Qwen3MoeForCausalLM

    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.loop.build import rollout_settings
    from gspo_megatron.rollout.build import build_evaluation

    cfg = to_train_config(compose(["+experiment=shaping_from_sft", f"model.hf_checkpoint={checkpoint}", *overrides]))
    producer, evaluation = build_evaluation(rollout_settings(cfg))
    weights = Qwen3MoeForCausalLM.from_pretrained(str(checkpoint)).state_dict()
    producer.engine.update_weights(weights.items(), version=0)
    try:
        return producer.evaluate(evaluation.records, evaluation.params)
    finally:
        producer.rewards.close()


def _commit(version: dict) -> str:
    return version["commit"] + (" (with uncommitted changes)" if version["dirty"] else "")


def calibrated_overrides(calibration: dict) -> list[str]:
    """The grsp_confidence arm's segmentation settings, from the calibration on the study's warm start."""
    best = calibration["best"]
    return [
        f"shaping.grsp.confidence_window={best['window']}",
        f"shaping.grsp.confidence_threshold={best['threshold']}",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="reports/shaping_study")
    parser.add_argument("--checkpoint", default="checkpoints/tiny_long_reasoner")
    parser.add_argument("--warm-start-steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=50, help="RL steps per run (trainer.steps)")
    parser.add_argument("--last-steps", type=int, default=10, help="training steps averaged per run")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every arm")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = QUICK["steps"], QUICK["seeds"]
    command = "python3 tools/shaping_study.py " + " ".join(argv if argv is not None else sys.argv[1:])

    import torch
    from regenerate_report import write_report

    from gspo_megatron.core.provenance import code_version, warm_start_record
    from study_reports.store import save_runs

    torch.set_num_threads(THREADS)  # the warm start's evaluation runs in this process
    version = code_version()
    out = (REPO / args.out).resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    checkpoint = (REPO / args.checkpoint).resolve()
    warm_args = ["tools/sft_warmstart.py", "--out", args.checkpoint, "--steps", str(args.warm_start_steps), *WARM_START]
    print(f"warm start -> {checkpoint}", flush=True)  # kept when its warm_start.json says it is current
    _run([sys.executable, *warm_args, "--keep-if-current"], out / "warm_start.log")
    warm_record = warm_start_record(checkpoint)
    if warm_record is None:
        raise SystemExit(f"no warm_start.json in {checkpoint} after sft_warmstart.py: see {out / 'warm_start.log'}")
    vanilla = evaluate_warm_start(checkpoint, args.overrides)
    calibration_path = out / "runs" / "confidence_calibration.json"
    print(f"calibrate confidence segmentation -> {calibration_path}", flush=True)
    calibrate = ["tools/calibrate_confidence_segmentation.py", "--checkpoint", args.checkpoint]
    _run([sys.executable, *calibrate, "--out", os.path.relpath(calibration_path, REPO)], out / "calibration.log")
    calibration = json.loads(calibration_path.read_text())
    arm_overrides = {arm: list(ARMS[arm]) for arm in args.arms}
    if "grsp_confidence" in arm_overrides:
        arm_overrides["grsp_confidence"] += calibrated_overrides(calibration)
    run_dirs = []
    for arm in args.arms:
        for seed in args.seeds:
            run_dir = out / "runs" / f"{arm}_s{seed}"
            if not reusable_run(run_dir, args.steps, version):
                shutil.rmtree(run_dir, ignore_errors=True)
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
                        f"trainer.eval_every={args.steps}",
                        f"run_dir={run_dir}",
                        *arm_overrides[arm],
                        *args.overrides,
                    ],
                    out / f"{arm}_s{seed}.log",
                )
            run_dirs.append(run_dir)
    # Tracked outputs only now: the runs stored with their manifests, the calibration, the report from the store.
    shutil.copyfile(calibration_path, out / "confidence_calibration.json")
    notes = [
        f"commit: {_commit(version)}",
        f"command: {command}",
        f"seeds: {args.seeds}; {args.steps} RL steps per run; evaluation at the last step; "
        f"{THREADS} CPU thread per process (OMP_NUM_THREADS; results depend on it)",
        f"warm start: {warm_record['command']} (commit {warm_record['commit'][:12]}, "
        f"weights sha256 {warm_record['weights_sha256'][:16]}); "
        f"evaluated as it is (the vanilla model): {json.dumps(vanilla)}",
        f"confidence segmentation calibrated on the warm start ({' '.join(calibrate)}): "
        f"window {calibration['best']['window']}, threshold {calibration['best']['threshold']} "
        f"(F1 {calibration['best']['f1']:.2f} against keyword boundaries; confidence_calibration.json)",
        f"per run: mean over its last {args.last_steps} training steps (rollout tokens: DTR arms cut these "
        "before any update); eval_* = the last evaluation (held-out prompts, plain decoding, no truncation: "
        "learned brevity); ± is the sample std over seeds",
        "arms: " + "; ".join(f"{a}: {' '.join(arm_overrides[a])}" for a in args.arms),
    ]
    for replaced in ("metrics", "configs"):  # the layout before the store: the runs' step logs and configs
        if (out / replaced).is_dir():
            shutil.rmtree(out / replaced)
    inputs = {
        "last_steps": args.last_steps,
        "vanilla": vanilla,
        "warm_start": warm_record,
        "confidence_calibration": calibration["best"],
        "notes": notes,
    }
    save_runs(run_dirs, out, "shaping_study", ("trainer.seed",), inputs)
    print(write_report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
