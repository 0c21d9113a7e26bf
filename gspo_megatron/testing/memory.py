"""Peak memory of one call, for the benchmarks in ``tools/`` and the weight-sync memory test.

CUDA: the allocator's peak above what was allocated before the call.

CPU: every allocation and free of torch's CPU allocator, on every thread. The CPU allocator reports to
c10's ``ProfiledCPUMemoryReporter``, which -- while c10's flag ``caffe2_report_cpu_memory_usage`` is
set -- keeps a table of the live blocks and their running total under one mutex, whichever thread
allocates or frees, and logs each change as ``C10 alloc|deleted N bytes, total alloc T bytes``. T is
the exact sum of the blocks allocated since the flag was set and not yet freed, at that instant; so
the peak of the call is ``max(T) - T0`` over the log lines of the window, T0 being the total just
before it. T0 comes from a sentinel block of a size nothing else allocates: its line says
``total alloc T`` with T = T0 + its size. The maximum does not depend on the order in which threads
write their lines, only on the totals, and every total is counted under the reporter's mutex.

Why not torch's profiler (what this module replayed before): it records only the threads it follows
(the one that started it and those torch hands its state to). A gloo worker that drops the last
reference of a broadcast tensor frees it unseen (the replay kept counting it until its address was
reused: it erred high), and gloo's own buffers (an all-gather's flat output) are allocated and freed
unseen (it erred low). ``profile_all_threads`` records other threads' operators but no memory events.

What is not counted: blocks allocated before the window (a free of one is unknown to the reporter and
leaves the total as it is, so an input freed by the call does not lower the peak), memory outside
torch's CPU allocator (Python objects, pinned memory, a backend's own buffers).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

# A size no other allocation in a window has (an odd prime): its log line marks the window's start.
SENTINEL_BYTES = 1_000_003
_LINE = re.compile(rb"C10 (alloc|deleted) (\d+) bytes, total alloc (\d+) bytes\.")
_INFO = 0  # c10's log severity of LOG(INFO); the reporter logs its changes at INFO
# the head of a c10 INFO line: [I<month><day> <time>, after "[rank<N>]:" once a process group exists
_C10_INFO = re.compile(rb"(\[rank\d+\]:)?\[I\d{4} \d")


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
    with _cpu_allocator_log() as log:
        sentinel = torch.empty(SENTINEL_BYTES, dtype=torch.uint8)
        del sentinel
        result = fn()
        del result
    return peak_from_allocator_log(log.text)


def peak_from_allocator_log(log: bytes) -> int:
    """``max(T) - T0`` over the reporter's lines after the sentinel's (see the module docstring)."""
    changes = [(kind, int(size), int(total)) for kind, size, total in _LINE.findall(log)]
    starts = [i for i, (kind, size, _) in enumerate(changes) if kind == b"alloc" and size == SENTINEL_BYTES]
    if not starts:
        raise RuntimeError(
            "torch's CPU allocator logged no allocations: this torch build does not report CPU memory "
            "through c10's ProfiledCPUMemoryReporter, so the CPU peak cannot be measured"
        )
    _, _, sentinel_total = changes[starts[0]]
    before = sentinel_total - SENTINEL_BYTES
    return max([0] + [total - before for _, _, total in changes[starts[0] + 1 :]])


class _AllocatorLog:
    """The reporter's lines of one window; ``text`` is filled when the window closes."""

    text: bytes = b""


@contextlib.contextmanager
def _cpu_allocator_log() -> Iterator[_AllocatorLog]:
    """Sets c10's report flag and INFO level, with the process's stderr (fd 2, where c10 logs) captured
    into a file; afterwards restores both and passes the other lines on to stderr (a process killed
    inside the window loses what it wrote there)."""
    c10 = _c10_library()
    report = ctypes.c_bool.in_dll(c10, "FLAGS_caffe2_report_cpu_memory_usage")
    level = ctypes.c_int.in_dll(c10, "FLAGS_caffe2_log_level")
    saved_report, saved_level = report.value, level.value
    log = _AllocatorLog()
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved_stderr = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            report.value, level.value = True, _INFO
            yield log
        finally:
            report.value, level.value = saved_report, saved_level
            sys.stderr.flush()
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
            capture.seek(0)
            lines = capture.read().splitlines(keepends=True)
            log.text = b"".join(line for line in lines if _is_allocator_line(line))
            # c10's other INFO lines were only written because of the raised level: dropped as before
            hidden = _is_allocator_line if saved_level <= _INFO else _is_allocator_or_c10_info_line
            others = b"".join(line for line in lines if not hidden(line))
            if others:
                os.write(2, others)


def _is_allocator_line(line: bytes) -> bool:
    return _LINE.search(line) is not None or b"Memory block of unknown size" in line


def _is_allocator_or_c10_info_line(line: bytes) -> bool:
    return _is_allocator_line(line) or _C10_INFO.match(line) is not None


def _c10_library() -> ctypes.CDLL:
    path = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise RuntimeError(f"cannot load {path} to switch on c10's CPU memory report: {error}") from error


# --- a whole run, by phase ----------------------------------------------------------------------
# Phase markers: blocks of sizes nothing else allocates (odd, just above the sentinel), one per mark.
_MARKER_BYTES = SENTINEL_BYTES + 2


class RunMemory:
    """The allocator's running total over a whole run, split at ``mark(name)`` calls.

    Opened before the model is built, so the total includes every resident tensor (weights, buffers,
    optimizer state, the engine's copy); ``peaks()`` is then the per-phase maximum of all bytes live
    in torch's CPU allocator, not the increase of one call. A phase's peak is the largest total
    logged between its mark and the next one (a marker's own line is left out). Totals count from
    the first mark: the reporter's total persists across recordings in one process, and blocks an
    earlier recording left that were freed while nothing recorded are never taken off it. Collect
    garbage before opening a second recording (a block of the first one freed inside the second
    would lower its totals)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._log: _AllocatorLog | None = None

    def mark(self, name: str) -> None:
        marker = torch.empty(_MARKER_BYTES + 2 * len(self._names), dtype=torch.uint8)
        self._names.append(name)
        del marker

    def windows(self) -> list[tuple[str, int, int]]:
        """(phase, total when it began, largest total inside it) per mark, in order."""
        if self._log is None:
            raise RuntimeError("RunMemory is read after the recording closed")
        sizes = {_MARKER_BYTES + 2 * i: i for i in range(len(self._names))}
        out: list[tuple[str, int, int]] = []
        base = 0
        for kind, size, total in _LINE.findall(self._log.text):
            if int(size) in sizes:
                if kind == b"alloc":  # the marker's line counts the marker: the phase begins below it
                    if not out:
                        base = int(total) - int(size)
                    start = int(total) - int(size) - base
                    out.append((self._names[sizes[int(size)]], start, start))
                continue
            if out:
                name, start, peak = out[-1]
                out[-1] = (name, start, max(peak, int(total) - base))
        return out

    def peaks(self) -> dict[str, int]:
        """Phase name -> the largest total in any of its windows."""
        out: dict[str, int] = {}
        for name, _, peak in self.windows():
            out[name] = max(out.get(name, 0), peak)
        return out


@contextlib.contextmanager
def run_memory() -> Iterator[RunMemory]:
    """Record the CPU allocator's running total from now until the block ends (``RunMemory``)."""
    record = RunMemory()
    with _cpu_allocator_log() as log:
        yield record
    record._log = log
