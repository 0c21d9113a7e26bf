"""The ``tools/compare_runs.py`` command in an experiment's header names the folders its sweep makes.

Issue 64: routing_comparison's header compared ``multirun/<date>/*_gspo``, but the sweep's folders are
named by ``hydra.sweep.subdir`` (``0_gspo_none``), so the command found no run. Here each sweep's folder
names are computed as Hydra's basic sweeper makes them (the product of ``hydra.sweeper.params``, numbered
in order, ``hydra.sweep.subdir`` resolved per job) and every path the header gives must match one.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config.compose import CONF_DIR, CONF_MODULE
from gspo_megatron.config.store import register_configs

SWEEP_DIR = "multirun/<date>"  # the headers' placeholder for the sweep directory (hydra.sweep.dir)
HEADERS = {
    p.stem: line
    for p in sorted((Path(CONF_DIR) / "experiment").glob("*.yaml"))
    for line in p.read_text().splitlines()
    if line.startswith("#") and re.search(r"tools/compare_runs\.py multirun/", line)
}


def sweep_folders(experiment: str) -> list[str]:
    """The folder name of each job of ``--multirun +experiment=NAME``, as Hydra's basic sweeper names them."""
    from hydra import compose, initialize_config_module

    register_configs()
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        base = compose("config", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
        params = base.hydra.sweeper.params or {}
        choices = [[f"{key}={value}" for value in str(values).split(",")] for key, values in params.items()]
        folders = []
        for number, combination in enumerate(itertools.product(*choices)):
            job = compose("config", overrides=[f"+experiment={experiment}", *combination], return_hydra_config=True)
            OmegaConf.update(job, "hydra.job.num", number, force_add=True)
            folders.append(str(job.hydra.sweep.subdir))
    return folders


def test_some_experiment_headers_name_a_compare_command():
    assert "routing_comparison" in HEADERS


@pytest.mark.parametrize("experiment", sorted(HEADERS))
def test_the_compare_command_in_the_header_finds_the_sweeps_runs(experiment):
    words = HEADERS[experiment].lstrip("# ").split()
    paths = words[words.index("tools/compare_runs.py") + 1 : words.index("--out")]
    assert paths, f"{experiment}'s header gives compare_runs.py no run"
    for path in paths:
        assert path.startswith(SWEEP_DIR), f"{experiment}: {path} is not under the sweep directory {SWEEP_DIR}"
    patterns = [path[len(SWEEP_DIR) :].lstrip("/") for path in paths]
    folders = sweep_folders(experiment) if any(patterns) else []  # the sweep directory itself holds every run
    for path, pattern in zip(paths, patterns, strict=True):
        assert not pattern or fnmatch.filter(folders, pattern), (
            f"{experiment}'s header: {path} matches none of its sweep's folders {folders}"
        )
