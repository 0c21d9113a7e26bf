"""Register the ``TrainConfig`` schema with Hydra's ConfigStore (``conf/config.yaml`` extends it)."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from gspo_megatron.config.schema import TrainConfig

SCHEMA_NAME = "train_schema"


def register_configs() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
