"""What host offload does to the device, which only a GPU can show (the CPU suite checks the values and
the protocol: tests/distributed/test_reference_model.py, test_distributed_optimizer.py).

- ``trainer.reference_offload``: between passes the reference's weights cost the device nothing (the
  allocated bytes after its build are below those of an on-device reference by its parameters' bytes,
  within the allocator's 512-byte rounding per tensor), its host buffers are pinned, and its log-probs
  equal the on-device reference's bit for bit.
- ``optimizer.cpu_offload``: megatron's HybridDeviceOptimizer on CUDA keeps the Adam moments of what it
  offloads in host memory after a real step (none of its host-side state on the device).
- ``rollout.sglang.weight_sync=tensor`` on a GPU: the payload carries CUDA IPC handles, and another
  process (not a child) maps the same device memory and reads the values the trainer holds.

Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo_megatron.testing.distributed import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROUNDING = 512  # the CUDA caching allocator rounds every allocation up to a multiple of 512 bytes


def reference_memory_worker(ctx, offload: bool) -> dict:
    from gspo_megatron.contracts.micro_batch import MicroBatch
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.policy.reference import ReferenceModel
    from gspo_megatron.testing.model_fixtures import fixed_batch, random_hf_state, tiny_test_config

    cfg = tiny_test_config()
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    state = random_hf_state(cfg, seed=3)
    before = torch.cuda.memory_allocated()
    chunk = build_model(cfg, layout, routing_replay=False, initialize=False)
    load_hf_weights(chunk, cfg, state, mesh)
    reference = ReferenceModel([chunk], mesh.tp_group, 1.0, None, row_parts_group=mesh.row_parts_group, offload=offload)
    torch.cuda.synchronize()
    between = torch.cuda.memory_allocated() - before
    inputs, targets, _ = fixed_batch(cfg)
    mb = MicroBatch(tokens=inputs.to(mesh.device), targets=targets.to(mesh.device))
    (ref_log_probs,) = reference.log_probs([mb])
    torch.cuda.synchronize()
    out = {
        "between": between,
        "after_pass": torch.cuda.memory_allocated() - before - ref_log_probs.untyped_storage().nbytes(),
        "param_bytes": sum(p.numel() * p.element_size() for p in chunk.parameters()),
        "params": len(list(chunk.parameters())),
        "devices": sorted({p.device.type for p in chunk.parameters()}),
        "pinned": all(p.is_pinned() for p in chunk.parameters()),
        "log_probs": mb.ref_log_probs.cpu(),
    }
    mesh.destroy()
    return out


def test_an_offloaded_reference_costs_the_device_nothing_between_passes():
    (on,) = run_distributed(reference_memory_worker, 1, False, timeout=600)
    (off,) = run_distributed(reference_memory_worker, 1, True, timeout=600)
    assert on["devices"] == ["cuda"] and off["devices"] == ["cpu"] and off["pinned"]
    for moment in ("between", "after_pass"):
        saved = on[moment] - off[moment]
        assert abs(saved - on["param_bytes"]) <= ROUNDING * on["params"], (moment, saved, on["param_bytes"])
    assert torch.equal(on["log_probs"], off["log_probs"])


def hybrid_optimizer_worker(ctx, run_dir: str) -> dict:
    from omegaconf import OmegaConf

    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.loop.build import build_trainer
    from gspo_megatron.policy.optimizer import allocate_optimizer_state
    from gspo_megatron.testing.train_runs import TINY_JOB

    overrides = [*TINY_JOB, "model.dtype=bfloat16", "optimizer.cpu_offload=true", "optimizer.distributed=true"]
    composed = compose(overrides)
    trainer = build_trainer(to_train_config(composed), Path(run_dir), OmegaConf.to_yaml(composed), world_size=1)
    policy = trainer.policy
    try:
        allocate_optimizer_state(policy.optimizer)
        devices = set()
        for part in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
            for sub in part.optimizer.cpu_optimizers:
                for group in sub.param_groups:
                    for param in group["params"]:
                        devices |= {param.device.type, *(v.device.type for v in sub.state[param].values())}
        return {"host_side_devices": sorted(devices)}
    finally:
        trainer.close()


def test_hybrid_device_optimizer_keeps_its_host_side_in_host_memory(tmp_path):
    (result,) = run_distributed(hybrid_optimizer_worker, 1, str(tmp_path), timeout=600)
    assert result["host_side_devices"] == ["cpu"]


IPC_READER = """
import base64, pickle, sys, torch
named = pickle.loads(base64.b64decode(sys.stdin.read()))
print(";".join(f"{name}:{t.device.type}:{float(t.double().sum()):.6f}" for name, t in named))
"""


def test_cuda_tensor_handles_map_in_another_process():
    import subprocess
    import sys

    from gspo_megatron.rollout.sglang.tensor_handles import serialize_named_tensors

    bucket = [
        ("w", torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(3, 4)),
        ("b", torch.ones(5, device="cuda")),
    ]
    payload = serialize_named_tensors(bucket)
    done = subprocess.run(
        [sys.executable, "-c", IPC_READER], input=payload, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "w:cuda:66.000000;b:cuda:5.000000"
