"""Hydra's record of a run -- ``.hydra/`` (the composed config, Hydra's own, the overrides) and
``train.log`` -- inside ``run_dir`` when ``run_dir=`` is given.

Design decisions:
- Hydra itself writes nothing when ``run_dir=`` is given (``config/store.py``); this writes what it
  would have, into the run directory and only after the claim (``run/run_dir_owner.py``): a refused
  start leaves a directory another run owns untouched, and a read-only one is named by the claim.
- ``train.log`` takes the root logger's records from the claim on (the dataset's warnings among
  them), in Hydra's format, appended across resumes as Hydra's own log file is.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from gspo_megatron.config.store import HYDRA_SUBDIR

TRAIN_LOG = "train.log"


def keep_hydra_output(cfg: DictConfig, run_dir: Path) -> None:
    """Write ``.hydra/`` and open ``train.log`` in ``run_dir`` where Hydra wrote neither (``run_dir=``
    given); nothing outside the Hydra entry point (tools and tests compose configs without it)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.output_subdir is not None:  # Hydra's own run directory: it wrote both there
        return
    subdir = run_dir / HYDRA_SUBDIR
    subdir.mkdir(exist_ok=True)
    OmegaConf.save(cfg, subdir / "config.yaml")
    OmegaConf.save(HydraConfig.instance().cfg, subdir / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, subdir / "overrides.yaml")
    handler = logging.FileHandler(run_dir / TRAIN_LOG)
    handler.setFormatter(logging.Formatter(hydra_cfg.job_logging["formatters"]["simple"]["format"]))
    logging.getLogger().addHandler(handler)
