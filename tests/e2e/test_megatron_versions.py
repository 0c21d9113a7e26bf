"""A checkpoint crosses megatron-core versions: written under 0.16.1 (common state in ``common.pt``) it
resumes under the installed megatron-core (0.19.2 in CI's newest-stack leg: common state inside DCP) and
continues exactly as 0.16.1 would have; written under the installed one it resumes under 0.16.1.

Runs where megatron-core 0.16.1 lies unpacked beside the interpreter (``launch/setup_newest_stack.sh``
puts it in ``.venv-newest/megatron-core-0.16.1``) and the installed one is another version; a
subprocess given that directory first on ``PYTHONPATH`` runs 0.16.1 with the same torch and
transformers. Both runs use the same torch, so any difference is megatron's.
"""

from __future__ import annotations

import shutil
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from gspo_megatron.policy.checkpoint.formats import COMMON_STATE_FILE, WRITTEN_BY_KEY
from gspo_megatron.policy.checkpoint.store import read_trainer_state
from gspo_megatron.testing.train_runs import FAST, read_metrics, run_training, without_time

pytestmark = pytest.mark.e2e

OLDEST = "0.16.1"
OLDEST_DIR = Path(sys.prefix) / f"megatron-core-{OLDEST}"
INSTALLED = version("megatron-core")
if not (OLDEST_DIR / "megatron" / "core").is_dir() or INSTALLED == OLDEST:
    pytest.skip(
        f"needs megatron-core {OLDEST} unpacked in {OLDEST_DIR} beside a newer installed one "
        "(launch/setup_newest_stack.sh makes both)",
        allow_module_level=True,
    )

# the entropy bonus gives every step a gradient, so the resumed steps depend on the restored Adam state
BASE = FAST + [
    "trainer.steps=4",
    "checkpoint.save_every=2",
    "algorithm.loss.entropy_coef=0.01",
    "routing.enabled=false",
]
WITH_OLDEST = {"PYTHONPATH": str(OLDEST_DIR)}


def _run(run_dir: Path, env: dict | None, *extra: str) -> list[dict]:
    done = run_training(BASE + list(extra), run_dir, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return read_metrics(run_dir)


def _resume_from_step_2(full: Path, tmp_path: Path, env: dict | None) -> list[dict]:
    """A copy of ``full`` cut back to its step-2 checkpoint, resumed to step 4."""
    cut = tmp_path / "resumed"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000004")
    (cut / "checkpoints" / "latest").write_text("step_000002")
    return _run(cut, env, "checkpoint.resume=true")


@pytest.mark.parametrize("writer", ["oldest", "installed"])
def test_a_checkpoint_resumes_exactly_under_the_other_megatron_core(tmp_path, writer):
    write_env, read_env = (WITH_OLDEST, None) if writer == "oldest" else (None, WITH_OLDEST)
    full = _run(tmp_path / "full", write_env)
    saved = tmp_path / "full" / "checkpoints" / "step_000002"
    assert read_trainer_state(saved)[WRITTEN_BY_KEY]["megatron-core"] == (OLDEST if writer == "oldest" else INSTALLED)
    assert (saved / "model_optim" / COMMON_STATE_FILE).is_file() == (writer == "oldest")  # the two formats
    resumed = _resume_from_step_2(tmp_path / "full", tmp_path, read_env)
    assert len(full) == len(resumed) == 4 and all(m["grad_norm"] > 0 for m in full)
    assert without_time(resumed) == without_time(full)
