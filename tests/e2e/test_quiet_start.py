"""The main job's first screen: no third-party warning beyond the reviewed list (core/known_warnings.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.core.known_warnings import optional_accelerators_notice
from gspo_megatron.testing.train_runs import WARNING_LINE

pytestmark = pytest.mark.e2e


def test_main_job_shows_no_unreviewed_warning(tmp_path):
    # the command: deprecations that will break us are errors, everything else must not show
    command = [sys.executable, "-W", "error::FutureWarning", "-m", "gspo_megatron.train", "trainer.steps=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    result = subprocess.run(
        [*command, f"run_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=600
    )
    screen = result.stdout + result.stderr
    assert result.returncode == 0, screen[-4000:]
    assert "run summary: 2 steps" in result.stdout
    # the thread count, said once (issue 65): here OMP_NUM_THREADS's, which wins over the rule
    assert result.stdout.count("threads: ") == 1, result.stdout[-4000:]
    assert "threads: 1 intra-op (OMP_NUM_THREADS=1 set in the environment; reward workers too)" in result.stdout
    assert WARNING_LINE.findall(screen) == [], screen[-4000:]
    notice = optional_accelerators_notice()
    assert screen.count("not installed") == (0 if notice is None else 1), screen[-4000:]
    if notice is not None:
        assert notice in result.stdout


REFUSED = ["model=tiny", "task=max_digit", "trainer.eval_samples=2", "rollout.eval_temperature=0"]
REFUSAL = "trainer.eval_samples=2 with greedy decoding (rollout.eval_temperature=0) gives k identical samples"


def _train(overrides, cwd, **env_vars):
    """The CLI in ``cwd`` (where Hydra makes ``runs/<time>_<algorithm>`` when run_dir= is not given)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root), **env_vars)
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "gspo_megatron.train", *overrides]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_refused_start_prints_its_message_alone_and_leaves_no_run_directory(tmp_path):
    """Issue 64 item 6: Hydra printed "Error executing job ..." and a traceback before the message, and
    its run directory (holding only .hydra/) stayed behind. HYDRA_FULL_ERROR=1 still shows the traceback."""
    result = _train(REFUSED, tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"[gspo] error: {REFUSAL}" in result.stderr
    assert "Traceback" not in result.stderr and "Error executing job" not in result.stderr, result.stderr
    assert list((tmp_path / "runs").iterdir()) == []
    full = _train(REFUSED, tmp_path, HYDRA_FULL_ERROR="1")
    assert full.returncode == 1 and "Traceback" in full.stderr and f"ConfigError: {REFUSAL}" in full.stderr
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_start_failing_after_the_claim_removes_only_the_directory_it_made(tmp_path):
    """The claim made new/run, .hydra/ and train.log were written, then the task refused its file: the
    directory goes. A directory the user made keeps what it held."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "", "answer": "1"}\n')
    task = ["task.name=jsonl", f"task.dataset.path={prompts}", "task.reward=last_number"]
    task += ["task.dataset.apply_chat_template=false", "model=tiny", "rollout.max_new_tokens=1"]
    result = _train([*task, f"run_dir={tmp_path / 'new' / 'run'}"], tmp_path)
    assert result.returncode == 1 and "prompts.jsonl:1: the prompt (field 'prompt') is empty" in result.stderr
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    result = _train([*task, f"run_dir={mine}"], tmp_path)
    assert result.returncode == 1 and (mine / "notes.txt").read_text() == "mine"


def test_a_two_rank_cpu_run_shows_no_warning_per_rank(tmp_path):
    """Issue 64 item 6: a tp2 run on CPU printed megatron's "set the environment variable
    CUDA_DEVICE_MAX_CONNECTIONS to 1" once per rank (megatron-core 0.16.1 too): advice for CUDA streams."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "gspo_megatron.launcher", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    command += ["parallel=tp2", "trainer.steps=1", f"run_dir={tmp_path / 'run'}"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    screen = result.stdout + result.stderr
    assert result.returncode == 0, screen[-4000:]
    assert "run summary: 1 steps" in result.stdout, screen[-4000:]
    assert WARNING_LINE.findall(screen) == [], screen[-4000:]
