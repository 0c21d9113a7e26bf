"""Per-step device-memory peaks for the step log (``memory/*``), read by ``tools/plan.py --calibrate``.

Design decisions:
- CUDA only: ``torch.cuda.max_memory_allocated`` (the tensors' peak since the process started: what
  the planner predicts) and ``max_memory_reserved`` (what the caching allocator held; the gap is the
  fragmentation the planner's ``reserve_gib`` has to cover). The largest over all ranks is logged:
  the planner reports the worst rank. One all-reduce of two numbers per step.
- On CPU nothing is logged: torch's CPU allocator keeps no peak. Its exact peak needs c10's reporter
  log (``testing/memory.py``), too costly for every step of every run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def device_memory_peaks(device: torch.device) -> dict[str, float]:
    """``memory/max_allocated_bytes`` and ``memory/max_reserved_bytes``: the max over ranks (CUDA), else {}."""
    if device.type != "cuda":
        return {}
    peaks = torch.tensor(
        [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
        dtype=torch.float64,
        device=device,
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    allocated, reserved = peaks.tolist()
    return {"memory/max_allocated_bytes": allocated, "memory/max_reserved_bytes": reserved}
