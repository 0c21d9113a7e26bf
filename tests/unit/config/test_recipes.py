"""The cluster recipes in conf/experiment/ compose, pass the trainer's start-up validation at their world
size, and plan as fitting their GPUs (``tools/plan.py``'s config mode: ``tools/planning/job.py``)."""

from __future__ import annotations

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config
from gspo_megatron.config.validate import validate_config
from planning.hardware import gpu_spec
from planning.job import compose_job, plan_job

# what the user adds: the checkpoint, the engines started beside the trainer (attach mode)
USER = ["rollout.sglang.model_path=/ckpt", "rollout.sglang.urls=[http://e0:30000]"]


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
