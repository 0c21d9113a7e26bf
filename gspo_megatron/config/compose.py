"""Compose ``conf/config.yaml`` with overrides outside the Hydra entry point (tools, tests), exactly
as ``python -m gspo_megatron.train`` would: the schema registered, the same search path."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from gspo_megatron.config.store import register_configs

    register_configs()  # idempotent: ConfigStore replaces the entry
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))
