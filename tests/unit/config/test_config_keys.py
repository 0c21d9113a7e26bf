"""The set of config keys is a contract with every run directory already written: a change to it is
deliberate (this snapshot), and a renamed key is migrated (``core/config_migrations.py``)."""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf

from gspo_megatron.config.resume_check import config_differences
from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.core.config_migrations import RENAMED, migrate_config
from gspo_megatron.core.config_node import flatten_dotted

SNAPSHOT = Path(__file__).with_name("config_keys.txt")
OLDER = Path(__file__).resolve().parents[2] / "e2e" / "data" / "config_1cd8a48_flat_algorithm.yaml"


def _keys() -> set[str]:
    return set(flatten_dotted(OmegaConf.to_container(OmegaConf.structured(TrainConfig))))


def test_the_config_keys_equal_the_snapshot():
    expected = set(SNAPSHOT.read_text().split())
    keys = _keys()
    assert keys == expected, (
        f"added: {sorted(keys - expected)}; gone: {sorted(expected - keys)}. A key that was renamed or moved "
        f"needs an entry in gspo_megatron/core/config_migrations.py (old run directories must resume); then "
        f"rewrite {SNAPSHOT.name} from the schema"
    )


def test_every_rename_leads_to_a_key_of_today_and_from_one_that_is_gone():
    keys = _keys()
    assert not set(RENAMED) & keys
    assert set(RENAMED.values()) <= keys


def test_a_config_written_before_the_nested_algorithm_migrates_to_todays_keys_with_its_values():
    saved = yaml.safe_load(OLDER.read_text())
    migrated, renames = migrate_config(saved)
    flat, old = flatten_dotted(migrated), flatten_dotted(saved)
    assert set(flat) - {"run_dir"} <= _keys()  # nothing left under a name today's code does not read
    removed = [f"{key} -> (removed)" for key in ("rollout.embedded.model", "rollout.embedded.model_config_path")]
    assert renames[-2:] == removed  # issue 63: keys no run read
    assert len(renames) - 2 == len(RENAMED) == 38 and "algorithm.routing_replay -> routing.replay" in renames
    for before, after in RENAMED.items():
        assert flat[after] == old[before]
    assert (flat["algorithm.loss.name"], flat["routing.replay"], flat["algorithm.loss.entropy_coef"]) == (
        "grpo",
        "old_policy",
        0.01,
    )
    assert migrate_config(migrated) == (migrated, [])  # today's layout passes unchanged
    assert saved == yaml.safe_load(OLDER.read_text())  # the given config is not changed


def test_old_lists_that_became_one_key_move_when_equal_and_name_each_other_when_not():
    equal = {"shaping": {"step_grpo": {"triggers": ["Wait"]}, "metrics": {"triggers": ["Wait"]}}}
    migrated, _ = migrate_config(equal)
    assert migrated["shaping"]["trigger_words"] == ["Wait"]
    assert migrated["shaping"] == {"step_grpo": {}, "metrics": {}, "trigger_words": ["Wait"]}
    differ = {"shaping": {"step_grpo": {"triggers": ["Wait"]}, "metrics": {"triggers": ["Hmm"]}}}
    value = migrate_config(differ)[0]["shaping"]["trigger_words"]
    # a text no run can set: the resume check refuses it by name instead of picking one list
    assert isinstance(value, str) and "shaping.step_grpo.triggers" in value and "shaping.metrics.triggers" in value


def test_a_saved_config_with_an_old_key_and_its_new_name_refuses_naming_both():
    # issue 63: the old key's value overwrote the new name's -- a resume at the old value was accepted, one at
    # the value the file's new key held was refused
    saved = "algorithm:\n  clip_low: 0.1\n  loss:\n    clip_low: 0.3\n"
    value = migrate_config(yaml.safe_load(saved))[0]["algorithm"]["loss"]["clip_low"]
    assert isinstance(value, str) and "algorithm.clip_low" in value and "algorithm.loss.clip_low" in value
    for resumed in (0.1, 0.3):
        differences = config_differences(saved, f"algorithm:\n  loss:\n    clip_low: {resumed}\n")
        assert list(differences) == ["algorithm.loss.clip_low"]
    agree = {"algorithm": {"clip_low": 0.3, "loss": {"clip_low": 0.3}}}
    assert migrate_config(agree)[0] == {"algorithm": {"loss": {"clip_low": 0.3}}}
