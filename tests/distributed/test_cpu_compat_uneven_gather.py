"""cpu_compat bridge 10 under real gloo ranks: megatron's uneven all-gather (sequence parallelism with
rows of different counts) runs through padding, forward and backward (the bridge's other facts:
tests/unit/policy/test_cpu_bridges.py)."""

from __future__ import annotations

import torch

from gspo_megatron.policy import cpu_bridges as cpu_compat
from gspo_megatron.testing.distributed import run_distributed


def uneven_gather_worker(ctx) -> dict:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    dist.init_process_group("gloo")
    sizes = [2, 3]  # rank r holds sizes[r] rows
    rows = torch.arange(sizes[ctx.rank] * 4.0).view(-1, 4) + 100 * ctx.rank
    out: dict = {}
    cpu_compat.disable_cpu_megatron()
    cpu_compat._current_device_is_cpu()  # bridge 1 only: megatron allocates its output on the CPU
    try:
        mappings._gather_along_first_dim(rows, dist.group.WORLD, sizes)
    except RuntimeError as exc:  # gloo: "invalid tensor size"
        out["without"] = str(exc)
    cpu_compat.disable_cpu_megatron()
    cpu_compat.enable_cpu_megatron()
    leaf = rows.clone().requires_grad_()
    gathered = mappings.gather_from_sequence_parallel_region(leaf, group=dist.group.WORLD, output_split_sizes=sizes)
    weights = torch.arange(gathered.numel(), dtype=torch.float32).view_as(gathered)  # the same on both ranks
    (gathered * weights).sum().backward()  # backward: megatron's uneven reduce-scatter (gloo runs it)
    out.update(gathered=gathered.detach(), grad=leaf.grad)
    return out


def test_10_uneven_all_gather_through_padding():
    results = run_distributed(uneven_gather_worker, 2, timeout=300)
    expected = torch.cat([torch.arange(8.0).view(2, 4), torch.arange(12.0).view(3, 4) + 100])
    weights = torch.arange(expected.numel(), dtype=torch.float32).view_as(expected)
    for rank, result in enumerate(results):
        assert "invalid tensor size" in result["without"]
        assert torch.equal(result["gathered"], expected)
        own = slice(0, 2) if rank == 0 else slice(2, 5)
        assert torch.equal(result["grad"], 2 * weights[own])  # both ranks' output gradients, summed
