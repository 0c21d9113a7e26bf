"""The training guide's resume example is accepted by the resume check it documents.

docs/training.md shows a long run and the command that continues it. Resume refuses a config that differs
from the checkpoint's (``config/resume_check.py``), so the continuing command must repeat the run's
overrides. Both lines are read from the guide and composed as ``train.py`` composes them.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from omegaconf import OmegaConf

from gspo_megatron.config.compose import compose
from gspo_megatron.config.resume_check import check_resume_config

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "training.md"


def _overrides(line: str) -> list[str]:
    return shlex.split(line.split("#", 1)[0])[3:]  # drop "python3 -m gspo_megatron.train"


def test_the_guide_resume_command_continues_the_guide_run():
    lines = [line for line in GUIDE.read_text().splitlines() if "run_dir=runs/long" in line]
    first = [line for line in lines if "checkpoint.resume" not in line]
    resume = [line for line in lines if "checkpoint.resume=true" in line]
    assert len(first) == 1 and len(resume) == 1, lines
    assert all(line.startswith("python3 -m gspo_megatron.train ") for line in lines)
    saved = OmegaConf.to_yaml(compose(_overrides(first[0])), resolve=True)
    new = OmegaConf.to_yaml(compose(_overrides(resume[0])), resolve=True)
    check_resume_config(saved, new, [], "runs/long/checkpoints/step_000400")  # raises on a difference
