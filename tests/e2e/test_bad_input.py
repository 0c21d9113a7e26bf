"""Bad input gets a clear error, and the run directory is never left corrupt."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.testing.distributed import DistributedRunError, run_distributed
from gspo_megatron.testing.train_runs import FAST, train_worker

pytestmark = pytest.mark.e2e


def _assert_not_corrupt(run_dir):
    """Either nothing was written, or what was written parses and no partial checkpoint exists."""
    if not run_dir.exists():
        return
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            json.loads(line)
    checkpoints = run_dir / "checkpoints"
    if checkpoints.exists():
        assert not list(checkpoints.glob("*.partial"))


def _dataset_overrides(path):
    return FAST + [
        "task.name=jsonl",
        f"task.dataset.path={path}",
        "task.reward=last_number",
        "task.dataset.apply_chat_template=false",
    ]


def test_bad_task_file(tmp_path):
    """A bad prompt file stops the run at start-up with the loader's message, the run directory intact.
    Each message (empty file, malformed JSON with its line, a missing field) is checked where it is
    raised, without a training: tests/unit/rollout/data/test_datasets.py."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "max 12=", "answer": "2"}\n{"prompt": "max 3\n')
    run_dir = tmp_path / "run"
    with pytest.raises(DistributedRunError, match=r"prompts.jsonl:2: malformed JSON"):
        run_distributed(train_worker, 1, _dataset_overrides(data), str(run_dir))
    _assert_not_corrupt(run_dir)


def test_empty_prompts_stop_the_start_and_leave_the_run_dir_free(tmp_path):
    """Issue 63 item 7: a file of empty prompts failed only at the first rollout ("prompt 0 is empty", no
    file or line), after config.yaml and metrics.jsonl were written, so a rerun into the same run_dir
    needed checkpoint.overwrite=true. It stops while the task is built, naming the file and line, with
    no run file written and the lock released: the same command runs again once the file is fixed."""
    from gspo_megatron.run.run_dir_owner import LOCK_FILE, check_fresh_start, existing_run_files

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "", "answer": "1"}\n{"prompt": "", "answer": "2"}\n')
    run_dir = tmp_path / "run"
    with pytest.raises(DistributedRunError, match=r"prompts.jsonl:1: the prompt \(field 'prompt'\) is empty"):
        run_distributed(train_worker, 1, _dataset_overrides(data), str(run_dir))
    assert existing_run_files(run_dir) == []
    assert not (run_dir / LOCK_FILE).exists()
    check_fresh_start(run_dir, overwrite=False)  # a rerun is not refused


def test_dataset_task_trains(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"max {n}=", "answer": max(str(n))}) + "\n" for n in range(100, 140)))
    (metrics,) = run_distributed(train_worker, 1, _dataset_overrides(data), str(tmp_path / "run"))
    assert len(metrics) == 2


def test_reward_function_that_raises(tmp_path):
    run_dir = tmp_path / "run"
    overrides = FAST + ["task.reward=import:gspo_megatron.testing.reward_doubles:always_raises"]
    with pytest.raises(DistributedRunError, match="failed on all .* samples.*broken on purpose"):
        run_distributed(train_worker, 1, overrides, str(run_dir))
    _assert_not_corrupt(run_dir)
    assert not (run_dir / "checkpoints").exists()


def test_missing_checkpoint_directory_is_named(tmp_path):
    with pytest.raises(DistributedRunError, match="no Hugging Face config at .*config.json"):
        run_distributed(train_worker, 1, FAST + [f"model.hf_checkpoint={tmp_path}"], str(tmp_path / "run"))


def test_prompts_past_the_model_context_are_not_trained_on(tmp_path):
    """D8: only task.dataset.max_prompt_tokens (1024) was applied, so rows longer than the tiny
    model's 256 positions were trained on; the context's budget (256 - rollout.max_new_tokens) drops them."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "max " + "7" * 300 + "=", "answer": "7"}) + "\n")
    with pytest.raises(DistributedRunError, match=r"all 1 prompts are longer than the 255 tokens the model's context"):
        run_distributed(train_worker, 1, _dataset_overrides(data), str(tmp_path / "run"))
