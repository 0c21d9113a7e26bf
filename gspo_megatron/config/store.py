"""Register the ``TrainConfig`` schema with Hydra's ConfigStore (``conf/config.yaml`` extends it), and the
resolvers ``conf/config.yaml``'s ``hydra:`` section reads.

Design decisions:
- With ``run_dir=`` given, Hydra writes nothing of its own: its run directory is the working directory
  (which exists, so nothing is created), ``hydra.output_subdir`` is null (no ``.hydra/``) and its log file
  handler is left off the root logger (``delay: true``: never opened). The run writes both into
  ``run_dir`` once it owns it (``run/hydra_output.py``), so nothing lands in the working directory, and
  a refused start touches nothing in a run directory another run owns. Without ``run_dir``, Hydra's
  own ``runs/<date>_<algorithm>`` is the run directory and Hydra writes into it as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from gspo_megatron.config.schema import TrainConfig

SCHEMA_NAME = "train_schema"
HYDRA_SUBDIR = ".hydra"


def _hydra_run_dir(run_dir: str | None, default: str) -> str:
    """``hydra.run.dir``: Hydra's dated directory, or the working directory when ``run_dir=`` is given."""
    return "." if run_dir else default


def _hydra_output_subdir(run_dir: str | None) -> str | None:
    """``hydra.output_subdir``: none when ``run_dir=`` is given (the run writes it into ``run_dir``)."""
    return None if run_dir else HYDRA_SUBDIR


def _hydra_log_handlers(run_dir: str | None) -> list[str]:
    """The root logger's handlers: Hydra's log file only in its own run directory."""
    return ["console"] if run_dir else ["console", "file"]


_RESOLVERS: dict[str, Callable[..., Any]] = {
    "gspo_hydra_run_dir": _hydra_run_dir,
    "gspo_hydra_output_subdir": _hydra_output_subdir,
    "gspo_hydra_log_handlers": _hydra_log_handlers,
}


def register_configs() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
    for name, resolver in _RESOLVERS.items():
        OmegaConf.register_new_resolver(name, resolver, replace=True)  # idempotent, like the store
