"""tools/bench_vs_trl.py cannot rot (issue 65): TRL's side reads the config through the trainer's typed
sections, and a TRL child that dies ends the benchmark at once with what it left (its traceback, or the
signal that killed it). The smoke run of our side is in test_bench_smoke.py."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import bench_vs_trl
import pytest

from gspo_megatron.algorithms.losses import SEQUENCE_LEVEL_LOSSES

ROOT = Path(__file__).resolve().parents[3]
HAS_TRL = importlib.util.find_spec("trl") is not None
NEEDS_TRL = pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed (pip install -e '.[bench]'): no TRL child")
SMALL = ["trainer.prompts_per_step=2", "rollout.group_size=2"]


@pytest.mark.parametrize("shape", sorted(bench_vs_trl.SHAPES))
@pytest.mark.parametrize("algorithm", ["gspo", "grpo"])
def test_trls_settings_are_read_through_the_trainers_typed_sections(shape, algorithm):
    """The four reads that broke (``a.kl_coef``, ``a.clip_low``, ``a.clip_high``, ``a.loss``) after the
    nested algorithm config raised AttributeError in TRL's process only; here they are read in the fast tier."""
    cfg = bench_vs_trl.compose_work([*bench_vs_trl.SHAPES[shape], *bench_vs_trl.COMMON, f"algorithm={algorithm}"])
    settings = bench_vs_trl.trl_settings(cfg, rounds=3, out_dir="unused")
    loss, trainer = cfg.algorithm.loss, cfg.trainer
    assert (settings["beta"], settings["epsilon"], settings["epsilon_high"]) == (
        cfg.algorithm.kl.coef,
        loss.clip_low,
        loss.clip_high,
    )
    level = "sequence" if loss.name in SEQUENCE_LEVEL_LOSSES else "token"
    assert settings["importance_sampling_level"] == level
    assert (algorithm == "gspo") == (level == "sequence")
    rows = trainer.prompts_per_step * cfg.rollout.group_size
    per_update = settings["per_device_train_batch_size"] * settings["gradient_accumulation_steps"]
    assert per_update * trainer.updates_per_rollout == rows  # the same mini-batches as ours
    assert settings["max_steps"] == 3 * trainer.updates_per_rollout
    assert settings["num_generations"] == cfg.rollout.group_size
    if HAS_TRL:  # TRL's own config accepts every keyword
        from trl import GRPOConfig

        GRPOConfig(**settings)


@pytest.mark.slow  # a spawned process that imports torch
def test_a_trl_run_that_raises_ends_run_trl_at_once_with_its_traceback(tmp_path):
    """Issue 65: the parent waited on the queue of a dead child forever (``queue.get()``). The child
    here raises (no TRL: ModuleNotFoundError; with TRL: no checkpoint at ``hf_dir``)."""
    cfg = bench_vs_trl.compose_work([*SMALL, *bench_vs_trl.COMMON])
    with pytest.raises(SystemExit) as stop:
        bench_vs_trl.run_trl(cfg, str(tmp_path / "no_checkpoint_here"), 2, 1)
    message = str(stop.value.code)
    assert "the TRL run (pid " in message and ") failed:" in message
    assert "Traceback (most recent call last)" in message
    assert ("No module named" if not HAS_TRL else "no_checkpoint_here") in message


def test_a_killed_child_is_named_by_its_signal():
    assert bench_vs_trl.exit_text(-signal.SIGKILL) == "killed by signal 9 (SIGKILL), no traceback"
    assert bench_vs_trl.exit_text(3) == "exit code 3 without a result"


@pytest.mark.slow
@NEEDS_TRL
def test_killing_trls_child_ends_the_benchmark_non_zero(tmp_path):
    """The benchmark prints each TRL child's pid as it starts; killing that child ends the benchmark
    with a non-zero status naming the signal (bounded: ``await_child`` looks at the child every second)."""
    command = [sys.executable, str(ROOT / "tools" / "bench_vs_trl.py"), "--shape", "default", "--rounds", "2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env["OMP_NUM_THREADS"] = "1"  # where TRL was found, this test's own path included
    bench = subprocess.Popen(
        [*command, "--reps", "1", *SMALL],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert bench.stdout is not None
        for line in bench.stdout:  # ends when the benchmark closes its stdout (exits)
            if line.startswith("TRL run started (pid "):
                os.kill(int(line.split("pid ")[1].rstrip(")\n")), signal.SIGKILL)
                break
        else:
            pytest.fail(f"no TRL child started; the benchmark said:\n{bench.stderr.read()[-3000:]}")
        _, stderr = bench.communicate(timeout=120)  # bounded wait on the benchmark's own exit
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(timeout=30)
    assert bench.returncode != 0
    assert "the TRL run (pid" in stderr and "killed by signal 9 (SIGKILL)" in stderr, stderr[-3000:]


@pytest.mark.slow
@NEEDS_TRL
def test_the_comparison_prints_both_columns_and_the_ratio(tmp_path):
    """The smoke run with TRL's side (test_bench_smoke.py runs ours alone, which needs no TRL)."""
    command = [sys.executable, str(ROOT / "tools" / "bench_vs_trl.py"), "--shape", "default", "--rounds", "2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [*command, "--reps", "1", *SMALL], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    number = r"\d+(?:\.\d+)?"
    for pattern in (
        rf"^rep 1/1: ours {number} s/round, TRL {number} s/round$",
        r"^\s+ours s\s+TRL s$",
        rf"^round\s+{number}\s+{number}$",
        rf"^  ratio\s+{number}x  \(ours / TRL; < 1: ours faster\)$",
        rf"^  old_logp\+prep\s+{number}$",
        rf"^tokens/s\s+{number}\s+{number}\s+\(completion tokens\)$",
        rf"^round min-max  ours {number}-{number}  TRL {number}-{number}; medians over 1 rounds each$",
    ):
        assert any(re.search(pattern, line) for line in done.stdout.splitlines()), (pattern, done.stdout[-3000:])
