"""Compose ``gspo_megatron/conf/config.yaml`` with overrides outside the Hydra entry point (tools,
tests), exactly as ``python -m gspo_megatron.train`` would: the schema registered, the same search
path (``CONF_MODULE``, package data, so an installed wheel composes the same configs)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONF_MODULE = "gspo_megatron.conf"
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # the same files, for tests that list them


def compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from gspo_megatron.config.known_keys import check_override_keys
    from gspo_megatron.config.store import register_configs

    check_override_keys(overrides)  # an unknown key named as train.py names it, '+' or not
    register_configs()  # idempotent: ConfigStore replaces the entry
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))
