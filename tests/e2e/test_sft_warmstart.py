"""The verbose-reasoner warm start: its responses, and a policy the trainer can start RL from."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.core.provenance import PROVENANCE_FILE, WARM_START_FILE, code_version, weights_sha256
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import SHORT, train_worker

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import sft_warmstart

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def test_verbose_response_adds_only_correct_rechecks():
    from gspo_megatron.rollout.data.config import TaskConfig
    from gspo_megatron.rollout.data.tasks import build_task
    from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer
    from gspo_megatron.rollout.rewards.registry import resolve_reward

    task = build_task(TaskConfig(name="reasoning_max_digit", min_digits=3, max_digits=3), SymbolTokenizer())
    rng = random.Random(0)
    waits = set()
    for record in task.next_batch(40):
        text = sft_warmstart.verbose_response(record, rng, max_waits=3)
        waits.add(text.count("Wait"))
        assert text.endswith(f"</think> answer {record.answer}")
        result = resolve_reward("think_answer")(text + "<eos>", record)
        assert result.correct and result.format_ok
    assert waits == {0, 1, 2, 3}


def test_lookup_demos_ask_about_another_world_and_train_only_what_the_model_writes():
    from gspo_megatron.rollout.data.fact_lookup import world
    from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer

    tokenizer = SymbolTokenizer()
    args = sft_warmstart.build_parser().parse_args(["--out", "x", "--demos", "lookup", "--tool-fraction", "0.5"])
    records = sft_warmstart.demo_task(args, tokenizer).next_batch(200)
    runs_entities = {fact.name for fact in world()}
    assert not {record.metadata["entity"] for record in records} & runs_entities  # no fact of the run shown
    rows = sft_warmstart.demo_rows(records, tokenizer, random.Random(0), args)
    calls = 0
    for record, (_, response, weights) in zip(records, rows, strict=True):
        text = tokenizer.decode(response)
        trained = tokenizer.decode([t for t, w in zip(response, weights, strict=True) if w == 1.0])
        if text.startswith("<lookup"):  # the call and the copied code trained, the document inserted
            calls += 1
            name, code = record.metadata["entity"], record.answer
            assert text == f"<lookup {name}> {name} code {code}\n{code}<eos>"
            assert trained == f"<lookup {name}>{code}<eos>"
        else:  # a guessed code, trained
            assert text == trained and len(text) == len("1234<eos>")
    assert 60 < calls < 140  # about half, as asked


def _sft_worker(ctx, out: str):
    sft_warmstart.main(["--out", out, "--steps", "200"])  # 3-digit problems, 0-3 re-checks


def test_warm_started_policy_trains_with_the_shapers(tmp_path):
    run_distributed(_sft_worker, 1, str(tmp_path / "sft"))
    assert (tmp_path / "sft" / "config.json").is_file()
    overrides = SHORT + [
        "+experiment=shaping_from_sft",
        f"model.hf_checkpoint={tmp_path / 'sft'}",
        "shaping=step_grpo",
        "trainer.steps=2",
        "trainer.eval_every=0",
        "task.min_digits=3",
        "task.max_digits=3",
    ]  # the problems it was warm-started on
    (metrics,) = run_distributed(train_worker, 1, overrides, str(tmp_path / "rl"))
    assert len(metrics) == 2
    # the warm start already answers in the reasoning format, verbosely
    assert metrics[0]["reward/accuracy"] > 0.5 and metrics[0]["response/length_mean"] > 20
    # the RL run records which warm start it came from, and its thread count
    record = json.loads((tmp_path / "sft" / WARM_START_FILE).read_text())
    assert record["weights_sha256"] == weights_sha256(tmp_path / "sft") and record["commit"] == code_version()["commit"]
    assert record["command"] == "python tools/sft_warmstart.py --out {} --steps 200".format(tmp_path / "sft")
    run = json.loads((tmp_path / "rl" / PROVENANCE_FILE).read_text())
    assert run["warm_start"] == record and isinstance(run["cpu_threads"], int)


def _warm_start(out: Path) -> str:
    command = [sys.executable, "tools/sft_warmstart.py", "--out", str(out), "--steps", "2", "--keep-if-current"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_keep_if_current_keeps_only_a_warm_start_of_this_command_commit_and_thread_count(tmp_path):
    """A study reuses a warm start only when the same command, clean commit and thread count wrote it;
    anything else (no record, a record of another commit, other threads) is rebuilt."""
    out = tmp_path / "ws"
    assert "wrote" in _warm_start(out)
    first = json.loads((out / WARM_START_FILE).read_text())
    assert first["cpu_threads"] == 1
    second = _warm_start(out)
    if code_version()["dirty"] is False:  # a clean checkout (CI's clone): the same command keeps it
        assert "kept" in second and json.loads((out / WARM_START_FILE).read_text()) == first
    else:  # uncommitted changes: no record can vouch for this code, so it is rebuilt
        assert "wrote" in second
    (out / WARM_START_FILE).write_text(json.dumps({**first, "commit": "0" * 40}))
    assert "wrote" in _warm_start(out)
    record = json.loads((out / WARM_START_FILE).read_text())
    assert record["weights_sha256"] == first["weights_sha256"]  # the same command wrote the same weights
