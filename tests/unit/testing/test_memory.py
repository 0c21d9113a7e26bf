"""The CPU peak of ``testing.memory.peak_bytes`` on hand-computed allocation patterns, including blocks
freed and allocated on a thread other than the caller's (as a gloo worker frees a broadcast bucket and
allocates an all-gather's buffer). torch's profiler, which the measurement replayed before, follows
only the caller's thread: it counted the cross-thread free until its address was reused (high) and
missed the other thread's allocation (low); for the pattern below it gave 8 or 12 MiB, never 10."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from gspo_megatron.testing.memory import SENTINEL_BYTES, peak_bytes, peak_from_allocator_log

MiB = 1 << 20


def _block(mib: int) -> torch.Tensor:
    return torch.empty(mib * MiB, dtype=torch.uint8)


def _on_other_thread(work: Callable[[], None]) -> None:
    thread = threading.Thread(target=work, name="not-the-callers-thread")
    thread.start()
    thread.join()


def test_same_thread_peak_is_the_most_bytes_live_at_once():
    def pattern():
        first, second = _block(4), _block(3)  # 7 live
        del first
        third = _block(2)  # 5 live
        del second, third
        return _block(1)  # dropped inside the window

    assert peak_bytes(pattern, "cpu") == 7 * MiB


def test_blocks_freed_and_allocated_on_another_thread_are_counted_when_they_happen():
    def pattern():
        handed_over = [_block(4)]
        _on_other_thread(handed_over.clear)  # 4 MiB freed on the other thread: 0 live
        both = _block(4), _block(4)  # 8 live
        del both
        held = _block(4)  # 4 live on this thread ...
        _on_other_thread(lambda: _block(6))  # ... while the other thread allocates 6 (and frees it): 10 live
        del held

    assert peak_bytes(pattern, "cpu") == 10 * MiB


def test_inputs_from_before_the_window_are_not_counted_and_their_free_does_not_lower_the_peak():
    existing = [_block(5)]

    def pattern():
        existing.clear()  # freed inside the window: its size is unknown to the reporter
        return _block(3)

    assert peak_bytes(pattern, "cpu") == 3 * MiB


def test_the_peak_is_taken_from_the_totals_after_the_sentinel_whatever_the_line_order():
    before = 100
    log = b"".join(
        f"[I CPUAllocator.cpp:1] C10 {kind} {size} bytes, total alloc {total} bytes.\n".encode()
        for kind, size, total in [
            ("alloc", 7, 50),  # before the window
            ("alloc", SENTINEL_BYTES, before + SENTINEL_BYTES),
            ("deleted", SENTINEL_BYTES, before),
            ("alloc", 30, before + 30 + 20),  # written after the line of the 20-byte block ...
            ("alloc", 20, before + 20),  # ... that came first under the reporter's mutex
            ("deleted", 30, before + 20),
        ]
    )
    assert peak_from_allocator_log(log) == 50


def test_run_memory_counts_resident_blocks_and_splits_at_marks():
    from gspo_megatron.testing.memory import run_memory

    with run_memory() as memory:
        memory.mark("build")
        resident = _block(4)  # lives through every later phase
        memory.mark("rollout")
        transient = _block(3)  # 7 live
        del transient
        memory.mark("update")
        held = [_block(2)]  # 6 live
        memory.mark("rollout")  # a second window of the same phase
        _on_other_thread(held.clear)  # the last reference dropped on another thread: 4 live
        late = _block(1)  # 5 live
        del late
    assert memory.windows() == [
        ("build", 0, 4 * MiB),
        ("rollout", 4 * MiB, 7 * MiB),
        ("update", 4 * MiB, 6 * MiB),
        ("rollout", 6 * MiB, 6 * MiB),
    ]
    assert memory.peaks() == {"build": 4 * MiB, "rollout": 7 * MiB, "update": 6 * MiB}
    del resident
