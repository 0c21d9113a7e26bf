"""Nothing typed is ignored (issue 63): a key the schema does not have is refused, with or without '+',
naming the closest known key (or, for a removed key, what replaces it); config groups and Hydra's own
keys still pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config.compose import compose
from gspo_megatron.config.resume_check import check_resume_config
from gspo_megatron.config.schema import to_train_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("override", ["trainer.stepz=3", "+trainer.stepz=3", "++trainer.stepz=3"])
def test_an_unknown_key_is_refused_naming_the_closest_with_or_without_plus(override):
    with pytest.raises(ValueError, match=r"trainer\.stepz is not a config key \(did you mean trainer\.steps\?"):
        compose([override])


def test_a_key_added_past_the_schema_is_refused_where_the_config_is_typed():
    """What '+' does inside Hydra (a merge under open_dict), reaching the one place the tree is typed."""
    cfg = compose([])
    OmegaConf.update(cfg, "trainer.stepz", 3, merge=True, force_add=True)  # hydra/_internal/config_loader_impl.py
    with pytest.raises(ValueError, match=r"trainer\.stepz .*did you mean trainer\.steps\?"):
        to_train_config(cfg)


def test_a_new_top_level_key_is_refused_listing_the_top_level_keys():
    with pytest.raises(ValueError, match=r"zzz is not a config key \(the top-level keys are algorithm, "):
        compose(["+zzz=1"])


@pytest.mark.parametrize(
    "override, replacement",
    [
        ("rollout.embedded.model_config_path=/ckpt", r"model\.hf_checkpoint=<dir>"),
        ("+rollout.embedded.model.num_experts=4", r"model\.\*"),
    ],
)
def test_the_embedded_engines_removed_keys_name_what_replaces_them(override, replacement):
    with pytest.raises(ValueError, match=rf"rollout\.embedded\.model\S* was removed: .*{replacement}"):
        compose([override])


def test_config_groups_and_known_keys_still_compose():
    cfg = compose(["+experiment=multi_token_demo", "model=tiny", "trainer.steps=3", "hydra.job.chdir=false"])
    assert to_train_config(cfg).trainer.steps == 3


def test_a_saved_config_holding_the_removed_engine_keys_still_resumes():
    """They were read by no run, so a saved config's values changed nothing: migrated away, not a difference."""
    saved = {"rollout": {"embedded": {"model": {"num_experts": 4}, "model_config_path": "/ckpt", "seed": 0}}}
    new = {"rollout": {"embedded": {"seed": 0}}}
    assert check_resume_config(OmegaConf.to_yaml(saved), OmegaConf.to_yaml(new), [], "ckpt") == []


def test_the_entry_point_refuses_plus_trainer_stepz_before_hydra_writes_anything(tmp_path):
    """``python -m gspo_megatron.train +trainer.stepz=3``: refused naming trainer.steps, nothing written
    (``--cfg job`` would otherwise print the config, stepz in it, and exit 0)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gspo_megatron.train",
            "+trainer.stepz=3",
            f"hydra.run.dir={tmp_path}/run",
            "--cfg",
            "job",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "trainer.stepz is not a config key (did you mean trainer.steps?)" in done.stderr
    assert list(tmp_path.iterdir()) == []
