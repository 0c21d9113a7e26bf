"""Compose ``gspo_megatron/conf/config.yaml`` with overrides outside the Hydra entry point (tools,
tests), exactly as ``python -m gspo_megatron.train`` would: the schema registered, the same search
path (``CONF_MODULE``, package data, so an installed wheel composes the same configs)."""

from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import DictConfig

CONF_MODULE = "gspo_megatron.conf"
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # the same files, for tests that list them


def compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from gspo_megatron.config.store import register_configs

    check_overrides(overrides)  # an unknown key named as train.py names it, '+' or not
    register_configs()  # idempotent: ConfigStore replaces the entry
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def check_overrides(overrides: list[str]) -> None:
    """Refuse an override of a key the schema does not have, with or without '+' (``config/known_keys.py``);
    a choice of a config group (a folder of ``conf/``: ``+experiment=...``) passes."""
    from gspo_megatron.config.known_keys import check_override_keys
    from gspo_megatron.config.schema import TrainConfig

    check_override_keys(overrides, TrainConfig, config_groups())


@functools.cache
def config_groups() -> frozenset[str]:
    return frozenset(p.name for p in Path(CONF_DIR).iterdir() if p.is_dir() and not p.name.startswith("_"))
