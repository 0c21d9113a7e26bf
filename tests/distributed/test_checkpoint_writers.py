"""The processes a checkpoint save leaves behind: megatron's writer-results manager is a fork of the
trainer, not a spawned interpreter that imports torch again on the first result it unpickles (2.2 s of
the main job's only save on 2 cores, before ``checkpoint.forked_write_results_queue``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.processes import children

pytestmark = pytest.mark.distributed


def save_twice_worker(ctx, checkpoint_dir: str) -> dict:
    import torch

    from gspo_megatron.policy.checkpoint.store import latest_checkpoint, save_checkpoint
    from gspo_megatron.policy.config import OptimizerSection
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.schedule import wrap_for_training
    from gspo_megatron.policy.optimizer import build_optimizer
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.testing.model_fixtures import tiny_test_config

    cfg = tiny_test_config()
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    initialize_parallel(layout, seed=11)
    model = build_model(cfg, layout, params_dtype=torch.float32)
    ddp = wrap_for_training(model, model.config, use_distributed_optimizer=False)
    optimizer, _ = build_optimizer(ddp, OptimizerSection(distributed="false"), total_updates=2)
    before = set(children(os.getpid()))
    for step in (1, 2):
        save_checkpoint(Path(checkpoint_dir), step, ddp, optimizer, {}, keep_last=1, is_driver=True)
    own = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return {
        "left": {pid: cmd for pid, cmd in children(os.getpid()).items() if pid not in before},
        "own": own,
        "latest": latest_checkpoint(checkpoint_dir).name,
    }


def test_the_writer_results_manager_is_forked_not_spawned(tmp_path):
    (result,) = run_distributed(save_twice_worker, 1, str(tmp_path), timeout=300)
    assert result["latest"] == "step_000002"
    # what outlives a save: the results manager, once (megatron caches its queue), as a fork of this
    # process (the same command line); a spawned one runs "from multiprocessing.spawn import spawn_main"
    assert len(result["left"]) == 1, result["left"]
    (cmdline,) = result["left"].values()
    assert "spawn_main" not in cmdline and cmdline == result["own"]
