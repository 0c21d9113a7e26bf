"""Peak memory of one call, for the benchmarks in ``tools/``.

CUDA: the allocator's peak above what was allocated before the call. CPU: torch's profiler reports
the CPU allocator's allocations and frees; replaying them in time order gives the peak of live bytes
during the call (inputs allocated before the call are not counted, anything the call allocates --
gradients included -- is). The replay keeps live blocks by address: a free the profiler did not see
(a block released on a thread it does not follow, e.g. a collective backend's worker) would otherwise
count forever, so a new block at a live block's address replaces it (the old one must have been
freed). A free that is never followed by reuse of its address still counts: the result errs high.
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
    events = []  # (time, signed bytes, address)

    def walk(node):
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if not events:
        raise RuntimeError("the profiler recorded no allocations; this torch build cannot measure CPU memory")
    live_blocks: dict[int, int] = {}  # address -> bytes, of blocks allocated inside the window
    live = peak = 0
    for _, delta, address in sorted(events):
        if delta > 0:
            live += delta - live_blocks.pop(address, 0)  # a reused address: its earlier block was freed
            live_blocks[address] = delta
        else:
            # a block from before the window shrinks the total too; one of ours leaves the table
            live += delta
            if live_blocks.get(address) == -delta:
                del live_blocks[address]
        peak = max(peak, live)
    return peak
