"""ConfigNode: sections validate as they are built and again in validate_config; a validated config
is frozen, so no part of a run can change a setting after start-up."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config
from gspo_megatron.config.validate import validate_config
from gspo_megatron.core.config_node import flatten_dotted, freeze_config, is_frozen
from gspo_megatron.policy.routing.config import RoutingConfig


def test_every_section_refuses_assignment_after_freezing_naming_the_field():
    cfg = freeze_config(to_train_config(compose(["algorithm=grpo_rollout_routing_replay"])))
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot set TrainerSection.steps: the config is frozen"):
        cfg.trainer.steps = 3
    for section in (cfg, cfg.model, cfg.algorithm, cfg.rollout.embedded, cfg.rollout.sglang, cfg.shaping.step_grpo):
        assert is_frozen(section), type(section).__name__
        name = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, name, getattr(section, name))
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(section, name)


def test_frozen_config_pickles_frozen_and_replace_gives_an_unfrozen_copy():
    cfg = freeze_config(to_train_config(compose([])))
    copy = pickle.loads(pickle.dumps(cfg))  # reward workers and spawned ranks receive it pickled
    assert is_frozen(copy.trainer) and copy == cfg
    changed = dataclasses.replace(cfg.trainer, steps=5)
    assert changed.steps == 5 and not is_frozen(changed)
    changed.steps = 6  # a new node is the caller's to fill in


def test_before_freezing_a_config_is_an_ordinary_dataclass():
    cfg = to_train_config(compose([]))
    cfg.trainer.steps = 3
    assert cfg.trainer.steps == 3 and not is_frozen(cfg)


def test_sections_validate_as_built_and_again_in_validate_config():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        RoutingConfig(every_n_steps=0)
    cfg = to_train_config(compose([]))
    cfg.rollout.embedded.max_batch_size = 0  # set after construction: validate_config still sees it
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        validate_config(cfg, 1)


def test_flatten_dotted_for_resume_diffs_and_run_grouping():
    tree = {"a": {"b": 1, "c": [1, "x"]}, "d": None}
    assert flatten_dotted(tree) == {"a.b": 1, "a.c": [1, "x"], "d": None}
    grouped = flatten_dotted(tree, hashable=True)
    assert grouped == {"a.b": 1, "a.c": ("1", "'x'"), "d": None} and hash(grouped["a.c"])
