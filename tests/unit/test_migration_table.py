"""docs/migration.md's table of the settings users change most: every row's override composes into the
typed config and lands on the key it names, and the table covers what issue 64 asked users to find
(lr, batch sizes, lengths, temperature, model path, TP/PP/EP/CP, KL, clip, loss aggregation)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config

MIGRATION = Path(__file__).resolve().parents[2] / "docs" / "migration.md"
HEADING = "## The settings you change most"
COVERED = [  # the list, each as the keys that must have a row
    "optimizer.lr",
    "trainer.prompts_per_step",
    "trainer.micro_batch_size",
    "rollout.max_new_tokens",
    "task.dataset.max_prompt_tokens",
    "rollout.temperature",
    "model.hf_checkpoint",
    "parallel.tp",
    "parallel.pp",
    "parallel.ep",
    "parallel.cp",
    "algorithm.kl.coef",
    "algorithm.loss.clip_low",
    "algorithm.loss.aggregation",
]


def _rows() -> list[list[str]]:
    """The overrides of each row (its first cell's backticked words), in the section's one table."""
    section = MIGRATION.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.findall(r"`([^`]+)`", line.split("|")[1])[0].split() for line in table]


ROWS = _rows()


def test_the_table_covers_the_settings_users_change_most():
    keys = {word.split("=", 1)[0] for row in ROWS for word in row}
    assert not [key for key in COVERED if key not in keys]
    for line in MIGRATION.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0].splitlines():
        if line.startswith("| `"):
            assert line.count("|") == 6, f"a row needs here | what | verl | slime | TRL: {line}"


@pytest.mark.parametrize("overrides", ROWS, ids=[" ".join(r) for r in ROWS])
def test_each_rows_override_composes_and_sets_its_key(overrides):
    needs = ["rollout.sglang.model_path=/ckpt"] if "rollout=sglang" in overrides else []
    cfg = compose([*overrides, *needs])
    to_train_config(cfg)  # types and each section's own rules
    for word in overrides:
        key, value = word.split("=", 1)
        if "." in key:  # a group choice (rollout=sglang) has no single key
            assert _same(OmegaConf.select(cfg, key), value), f"{word}: composed {OmegaConf.select(cfg, key)!r}"


def _same(composed: object, written: str) -> bool:
    """The composed value is the one written (numbers by value: 3e-4 composes as 0.0003)."""
    try:
        return float(composed) == float(written)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(composed) == written
