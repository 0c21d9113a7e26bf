"""The verbose-reasoner warm start: its responses, and a policy the trainer can start RL from."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import FAST, train_worker

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import sft_warmstart

pytestmark = pytest.mark.e2e


def test_verbose_response_adds_only_correct_rechecks():
    from gspo_megatron.data.config import TaskConfig
    from gspo_megatron.data.tasks import build_task
    from gspo_megatron.data.tokenizer import SymbolTokenizer
    from gspo_megatron.rewards.registry import resolve_reward

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


def _sft_worker(ctx, out: str):
    sft_warmstart.main(["--out", out, "--steps", "200"])  # 3-digit problems, 0-3 re-checks


def test_warm_started_policy_trains_with_the_shapers(tmp_path):
    run_distributed(_sft_worker, 1, str(tmp_path / "sft"))
    assert (tmp_path / "sft" / "config.json").is_file()
    overrides = FAST + [
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
