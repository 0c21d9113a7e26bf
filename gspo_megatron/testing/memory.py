"""Peak memory of one call, for the benchmarks in ``tools/``.

CUDA: the allocator's peak above what was allocated before the call. CPU: torch's profiler reports
every allocation and free of the CPU allocator; replaying them in time order gives the peak of live
bytes during the call (inputs allocated before the call are not counted, anything the call
allocates -- gradients included -- is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def peak_bytes(fn: Callable[[], object], device) -> int:
    """Peak bytes allocated while ``fn()`` runs (its return value is dropped inside the window)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        del result
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        del result
    events = []  # (time, signed bytes)

    def walk(node):
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if not events:
        raise RuntimeError("the profiler recorded no allocations; this torch build cannot measure CPU memory")
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak
