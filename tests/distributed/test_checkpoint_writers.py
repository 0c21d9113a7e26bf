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


def bucket_padding_worker(ctx, checkpoint_dir: str) -> dict:
    """Two saves of the same distributed-optimizer state on 2 data-parallel ranks: the bucket-space padding
    megatron fills with ``torch.empty`` is saved as zeros, and the two saves' files are the same bytes."""
    import torch
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    from gspo_megatron.policy.checkpoint.store import _sharded_state, save_checkpoint
    from gspo_megatron.policy.config import OptimizerSection
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.schedule import wrap_for_training
    from gspo_megatron.policy.optimizer import allocate_optimizer_state, build_optimizer
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.testing.model_fixtures import tiny_test_config

    cfg = tiny_test_config()
    layout = ParallelLayout(world_size=ctx.world_size).validate(cfg)
    apply_cpu_bridges()
    initialize_parallel(layout, seed=11)
    model = build_model(cfg, layout, params_dtype=torch.float32)
    ddp = wrap_for_training(model, model.config, use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(ddp, OptimizerSection(distributed="true"), total_updates=2)
    allocate_optimizer_state(optimizer)
    padding = []
    pending: list = [_sharded_state(ddp, optimizer, is_loading=False)["optimizer"]]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            flag = node.get("padding")
            if isinstance(flag, LocalNonpersistentObject) and flag.unwrap() is True:
                padding += [v.data for v in node.values() if isinstance(v, ShardedTensor)]
            else:
                pending.extend(node.values())
        elif isinstance(node, list | tuple):
            pending.extend(node)
    for name in ("a", "b"):
        save_checkpoint(Path(checkpoint_dir) / name, 1, ddp, optimizer, {}, keep_last=1, is_driver=ctx.rank == 0)
    return {"pieces": len(padding), "nonzero": sum(int(t.count_nonzero()) for t in padding)}


def test_the_distributed_optimizers_padding_is_saved_as_zeros(tmp_path):
    results = run_distributed(bucket_padding_worker, 2, str(tmp_path), timeout=300)
    assert sum(r["pieces"] for r in results) > 0  # the tiny model's buckets have gaps between parameters
    assert [r["nonzero"] for r in results] == [0, 0]
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.distcp"))
    assert files
    for file in files:  # the same state saved twice: the same bytes (the padding was whatever memory held)
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
