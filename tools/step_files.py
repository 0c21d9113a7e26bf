"""Which files of the package one RL step's code runs in, in the order it first reaches them, and which
of them the step file (``loop/trainer.py``) calls into directly.

    python tools/step_files.py                          # the main job's second step
    python tools/step_files.py algorithm=grpo_routing_replay parallel=single   # any overrides

A profile hook (``sys.setprofile``, and ``threading.setprofile`` for the engine's and the reward pool's
threads) records each function call whose code lives in ``gspo_megatron/`` during ``train_step`` of the
second step (the first also builds what is cached); setup, checkpoints and the run summary are outside
it. A call is direct when its caller's code is the step file's. docs/architecture.md "One RL step, file
by file" quotes both counts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

PACKAGE = "/gspo_megatron/"
STEP_FILE = "loop/trainer.py"


def step_files(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Package files (relative to ``gspo_megatron/``) the code of step 2 runs in, first call first, and
    those of them the step file calls functions of (itself included), in the same order."""
    from gspo_megatron.config.compose import compose
    from gspo_megatron.loop import trainer
    from gspo_megatron.train import run

    seen: list[str] = []
    direct: list[str] = []
    train_step = trainer.RLTrainer.train_step

    def hook(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and PACKAGE in name:
            relative = name.split(PACKAGE, 1)[1]
            if relative not in seen:
                seen.append(relative)
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            if caller.endswith(PACKAGE + STEP_FILE) and relative not in direct:
                direct.append(relative)

    def traced(self):
        if self.step != 1:
            return train_step(self)
        sys.setprofile(hook)
        threading.setprofile(hook)
        try:
            return train_step(self)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    trainer.RLTrainer.train_step = traced  # type: ignore[method-assign]
    try:
        run_dir = tempfile.mkdtemp(prefix="step_files_")
        fixed = ["trainer.steps=2", "trainer.eval_every=0", "logging.progress=false", "logging.charts=false"]
        run(compose([*overrides, *fixed]), run_dir)
    finally:
        trainer.RLTrainer.train_step = train_step  # type: ignore[method-assign]
    return seen, [file for file in seen if file in direct]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the job (default: the main job)")
    args = parser.parse_args()
    files, direct = step_files(args.overrides)
    print("\n".join(files))
    print(f"{len(files)} files of gspo_megatron run in one train_step")
    print(f"the step file ({STEP_FILE}) calls functions of {len(direct)} of them directly:")
    print("\n".join(f"  {file}" for file in direct))


if __name__ == "__main__":
    main()
