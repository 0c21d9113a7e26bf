"""What the main job imports before its first round: only what training needs (issue 28, start-up).

Start-up time is imports (torch, megatron-core, transformers); these tests guard the paths the main
job does not take by what is in ``sys.modules``, never by a clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from gspo_megatron.testing.fresh_interpreter import run_in_fresh_interpreter
from gspo_megatron.testing.train_runs import FAST

pytestmark = pytest.mark.e2e

# Each with the reason the main job (embedded engine, a built-in reward, logging.tensorboard=false)
# has no use for it before its first round.
NOT_BEFORE_THE_FIRST_ROUND = {
    "httpx": "the SGLang engine's HTTP client (rollout=sglang only)",
    "gspo_megatron.rollout.sglang.engine": "rollout=sglang only",
    "tensorboard": "logging.tensorboard=false; megatron.core.timers' import is deferred",
    "torch.utils.tensorboard": "as above",
    "matplotlib": "the reports at the end of the run",
    "pyarrow": "parquet datasets only (task=dataset)",
    "torch._inductor.compile_fx": "megatron's @jit_fuser kernels compile on first call (core/deferred_compile.py)",
}

# The real entry point (python -m gspo_megatron.train), noting sys.modules when the first round begins.
DRIVER = textwrap.dedent(
    """
    import json, runpy, sys

    def note_modules_at_the_first_round(out):
        from gspo_megatron.loop.trainer import RLTrainer
        train_step = RLTrainer.train_step

        def first_round_notes_modules(trainer):
            if not trainer.step:
                with open(out, "w") as handle:
                    json.dump(sorted(sys.modules), handle)
            return train_step(trainer)

        RLTrainer.train_step = first_round_notes_modules

    if __name__ == "__main__":
        note_modules_at_the_first_round(sys.argv.pop(1))
        runpy.run_module("gspo_megatron.train", run_name="__main__", alter_sys=True)
    """
)


def test_the_main_job_imports_only_what_training_needs_before_its_first_round(tmp_path):
    driver, modules_file = tmp_path / "driver.py", tmp_path / "modules.json"
    driver.write_text(DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, str(driver), str(modules_file), f"run_dir={tmp_path / 'run'}", *FAST, "trainer.steps=1"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "run summary: 1 steps" in result.stdout, result.stdout[-2000:]
    loaded = set(json.loads(modules_file.read_text()))
    assert {"torch", "megatron.core", "transformers"} <= loaded  # the notes are of a real start-up
    found = {name: why for name, why in NOT_BEFORE_THE_FIRST_ROUND.items() if name in loaded}
    assert found == {}, found


def test_the_sglang_engine_is_imported_on_first_use_only():
    probe = (
        "import sys\n"
        "import gspo_megatron.config.schema\n"
        "assert 'httpx' not in sys.modules and 'gspo_megatron.rollout.sglang.engine' not in sys.modules\n"
        "from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine, WeightSyncError\n"
        "from gspo_megatron.rollout.sglang import engine\n"
        "assert SGLangEngine is engine.SGLangEngine and WeightSyncError is engine.WeightSyncError\n"
        "import gspo_megatron.rollout.sglang as package\n"
        "try:\n"
        "    package.NoSuchName\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
    )
    assert run_in_fresh_interpreter(probe) == "module 'gspo_megatron.rollout.sglang' has no attribute 'NoSuchName'"
