"""The cluster recipes in conf/experiment/ compose, pass the trainer's start-up validation at their world
size, and plan as fitting their GPUs (``tools/plan.py``'s config mode: ``planning/job.py``)."""

from __future__ import annotations

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config
from gspo_megatron.config.validate import validate_config
from gspo_megatron.planning.hardware import gpu_spec
from gspo_megatron.planning.job import job_from_config, plan_job

# what the user adds: the checkpoint's tokenizer, the prompts, the engines started beside the trainer
USER = ["tokenizer.path=/ckpt", "task.dataset.path=/data/train.jsonl", "rollout.sglang.urls=[http://e0:30000]"]


def test_slimes_235b_job_is_accepted_and_fits_64_h100s():
    cfg = to_train_config(compose(["+experiment=qwen3_235b_a22b_64xh100", *USER]))
    validate_config(cfg, 64)
    layout = (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.ep, cfg.parallel.etp)
    assert layout == (4, 4, 2, 16, 1) and cfg.parallel.last_stage_layers == 22  # slime's
    assert cfg.optimizer.cpu_offload and cfg.optimizer.precision_aware and cfg.trainer.recompute_activations
    plan = plan_job(job_from_config(cfg, 64, prompt_tokens=1024), gpu_spec("h100"))
    assert plan.fits, plan.problems
    assert plan.layout.stage_layer_counts(cfg.model.num_layers) == [24, 24, 24, 22]
