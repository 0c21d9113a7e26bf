"""The cluster recipes in conf/experiment/ compose, pass the trainer's start-up validation at their world
size, and plan as fitting their GPUs (``tools/plan.py``'s config mode: ``tools/planning/job.py``); the toy
job's settings come from its task, and a real-size model composed with them is warned about
(``config/recipes.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config.compose import CONF_DIR, compose
from gspo_megatron.config.recipes import toy_settings_notice
from gspo_megatron.config.schema import to_train_config
from gspo_megatron.config.validate import validate_config
from gspo_megatron.core.tool_call_formats import FAMILY_TOOL_CALL_FORMAT
from gspo_megatron.rollout.agents.toolkit import ToolKit
from planning.hardware import gpu_spec
from planning.job import compose_job, plan_job

# what the user adds: the checkpoint, the engines started beside the trainer (attach mode)
USER = ["rollout.sglang.model_path=/ckpt", "rollout.sglang.urls=[http://e0:30000]"]
ROOT = Path(__file__).resolve().parents[3]


def test_slimes_235b_job_is_accepted_and_fits_64_h100s():
    cfg = to_train_config(compose(["+experiment=qwen3_235b_a22b_64xh100", *USER, "model.hf_checkpoint=null"]))
    validate_config(cfg, 64)
    layout = (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.ep, cfg.parallel.etp)
    assert layout == (4, 4, 2, 16, 1) and cfg.parallel.last_stage_layers == 22  # slime's
    assert cfg.optimizer.cpu_offload and cfg.optimizer.precision_aware and cfg.trainer.recompute_activations
    plan = plan_job(compose_job(["+experiment=qwen3_235b_a22b_64xh100", *USER], 64, 1024), gpu_spec("h100"))
    assert plan.fits, plan.problems
    assert plan.layout.stage_layer_counts(cfg.model.num_layers) == [24, 24, 24, 22]


def test_slimes_30b_job_fits_one_node_of_8_h100s_colocated():
    """The issue's command: ``tools/plan.py +experiment=qwen3_30b_a3b_8xh100 rollout.sglang.model_path=/ckpt
    --gpus 8`` fits with 8 GPUs in all (the engine on the trainer's GPUs); the trainer accepts the config."""
    overrides = ["+experiment=qwen3_30b_a3b_8xh100", "rollout.sglang.model_path=/ckpt"]
    job = compose_job(overrides, 8, prompt_tokens=1024)  # /ckpt is not here: the configured shape stands in
    plan = plan_job(job, gpu_spec("h100"))
    assert plan.fits, plan.problems
    assert plan.total_gpus == 8 and plan.rollout_gpus == 0
    cfg = to_train_config(compose([*overrides, "model.hf_checkpoint=null"]))
    validate_config(cfg, 8)
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.etp) == (4, 8, 1)  # slime's
    assert cfg.rollout.placement == "colocated" and cfg.rollout.sglang.weight_sync == "tensor"
    assert cfg.optimizer.cpu_offload and cfg.optimizer.precision_aware and cfg.trainer.reference_offload


def test_the_qwen3_lookup_agent_recipe_is_the_30b_job_with_the_tool_calling_agent(monkeypatch):
    """docs/agents.md's Qwen3-MoE agent command: no checkpoint here, so the trainer's start-up validation and the
    agent's tools (the task's corpus, read from the repository root) stand for the run."""
    recipe = ["+experiment=qwen3_30b_a3b_agent_lookup_8xh100", "rollout.sglang.model_path=/ckpt"]
    cfg = to_train_config(compose([*recipe, "model.hf_checkpoint=null"]))
    validate_config(cfg, 8)
    base = to_train_config(compose(["+experiment=qwen3_30b_a3b_8xh100", "rollout.sglang.model_path=/ckpt"]))
    assert (cfg.parallel, cfg.optimizer, cfg.rollout.sglang) == (base.parallel, base.optimizer, base.rollout.sglang)
    assert cfg.trainer.micro_batch_size == base.trainer.micro_batch_size  # not the toy task's
    assert cfg.task.name == "fact_lookup" and cfg.task.reward == "last_number" and cfg.tokenizer.kind == "hf"
    agent = cfg.rollout.agent
    assert agent.name == "tool_calling" and agent.tools == ["lookup"] and agent.tool_format == "auto"
    assert FAMILY_TOOL_CALL_FORMAT[cfg.model.family] == "hermes_json"  # what "auto" resolves to for Qwen3
    monkeypatch.chdir(ROOT)
    assert [spec.name for spec in ToolKit(agent).specs()] == ["lookup"]  # the shipped corpus, read
    assert toy_settings_notice(cfg) is None


# --- every cluster recipe: planned on its GPUs, named in the README (issue 64) --------------------------------

RECIPE_GPUS = {  # recipe -> (training GPUs, what its user adds beyond the checkpoint)
    "qwen3_30b_a3b_8xh100": (8, []),
    "qwen3_30b_a3b_agent_lookup_8xh100": (8, []),
    "qwen3_5_35b_a3b_8xh100": (8, []),
    "qwen3_235b_a22b_64xh100": (64, ["rollout.sglang.urls=[http://e0:30000,http://e1:30000]"]),
}
EXPERIMENTS = Path(CONF_DIR) / "experiment"


def test_every_cluster_recipe_is_planned_here():
    found = {p.stem for p in EXPERIMENTS.glob("*.yaml") if re.search(r"_\d+xh100$", p.stem)}
    assert found == set(RECIPE_GPUS), "a cluster recipe (conf/experiment/*_Nxh100.yaml) without a plan here"


@pytest.mark.parametrize("recipe", sorted(RECIPE_GPUS))
def test_each_cluster_recipe_fits_its_gpus_and_the_readme_names_it(recipe):
    gpus, extra = RECIPE_GPUS[recipe]
    plan = plan_job(
        compose_job([f"+experiment={recipe}", "rollout.sglang.model_path=/ckpt", *extra], gpus, 1024), gpu_spec("h100")
    )
    assert plan.fits, f"{recipe} on {gpus} H100s: {plan.problems}"
    assert f"+experiment={recipe}" in (ROOT / "README.md").read_text()


# --- the toy job's settings live with the toy task; a real-size model with them is warned about ---------------

TOY = {"rollout.max_new_tokens": 3, "rollout.group_size": 16, "trainer.micro_batch_size": 128, "optimizer.lr": 1e-3}


def _values(cfg, keys):
    return {key: OmegaConf.select(cfg, key) for key in keys}


def test_the_main_job_keeps_its_settings_from_its_task_and_jsonl_math_brings_a_real_runs():
    """The settings conf/config.yaml held before the move: the main job composes them, now from
    conf/task/running_max.yaml; another rollout engine does not change them; task=jsonl_math replaces each."""
    main = compose([])
    assert _values(main, TOY) == TOY
    assert main == compose([f"{key}={value}" for key, value in TOY.items()])  # nothing else moved
    assert _values(compose(["rollout=sglang", "rollout.sglang.model_path=/ckpt"]), TOY) == TOY
    math = compose(["task=jsonl_math", "task.dataset.path=/data/math.jsonl"])
    assert all(OmegaConf.select(math, key) != value for key, value in TOY.items())
    assert math.rollout.max_new_tokens >= 1024 and math.optimizer.lr <= 1e-5 and math.trainer.micro_batch_tokens


@pytest.mark.parametrize(
    "model, recipe",
    [("qwen3_30b_a3b", "+experiment=qwen3_30b_a3b_8xh100"), ("qwen3_235b_a22b", "+experiment=qwen3_235b_a22b_64xh100")],
)
def test_a_real_model_with_the_toy_settings_is_warned_about_naming_the_recipe(model, recipe):
    notice = toy_settings_notice(to_train_config(compose([f"model={model}"])))
    assert notice is not None and recipe in notice
    for key in ("tokenizer.kind=symbol", "optimizer.lr=0.001", "rollout.max_new_tokens=3"):
        assert key in notice


def test_no_warning_for_the_main_job_the_recipes_or_a_real_model_with_real_settings():
    real = [
        "model=qwen3_30b_a3b",
        "task=jsonl_math",
        "task.dataset.path=/d.jsonl",
        "tokenizer.kind=hf",
        "tokenizer.path=/t",
    ]
    for overrides in (
        [],
        ["+experiment=qwen3_30b_a3b_8xh100", "rollout.sglang.model_path=/ckpt", "model.hf_checkpoint=null"],
        [
            "+experiment=qwen3_30b_a3b_agent_lookup_8xh100",
            "rollout.sglang.model_path=/ckpt",
            "model.hf_checkpoint=null",
        ],
        real,
    ):
        assert toy_settings_notice(to_train_config(compose(overrides))) is None, overrides
    assert "optimizer.lr=0.001" in toy_settings_notice(to_train_config(compose([*real, "optimizer.lr=1e-3"])))
