"""Run a function on N gloo ranks on this machine and collect what each rank returns.

Design decisions:
- Ranks are fresh processes started by ``multiprocessing``, not torchrun, so a pytest test can call a
  plain Python function and get per-rank return values back.
- Without CUDA they are forked from a fork server that imported torch, megatron-core and the rest of
  a training run's third-party modules once (``rank_preload``): importing them costs each spawned rank
  5-12 s on a loaded 2-core machine, more than most tests compute. A forked rank is still a new
  process that ran no test: module state is as the import left it, and the caller's environment,
  working directory, stdout and stderr are handed over per call. With CUDA (forking after CUDA
  initialises breaks it), or with GSPO_RANK_START=spawn (tools/bench_rank_start.py compares the two),
  ranks are spawned.
- Each rank's result or traceback travels back over a queue; the first failure is re-raised in the
  caller with every failing rank's traceback, so a broken rank names itself.
- Processes are always reaped: on timeout or failure every rank this call started is killed, and
  only those (no process-group kill of the test runner's siblings).
- The function must be importable (a module-level function) because spawn pickles it by name.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from gspo_megatron.core.ports import free_port

RANK_START_ENV = "GSPO_RANK_START"


class DistributedRunError(RuntimeError):
    """One or more ranks failed (or the run timed out); the message holds each rank's traceback."""


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int


class _InheritedFd:
    """A file descriptor of the caller's, duplicated into the rank when the process is started."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        # DupFd is only valid while multiprocessing pickles the process (it registers the fd with the
        # starting Popen), so it is made here, at pickling time.
        from multiprocessing import reduction

        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup_fd) -> int:
    return dup_fd.detach()


@dataclass(frozen=True)
class _CallerState:
    """What a spawned rank would inherit from the caller and a forked one must be given."""

    environ: dict[str, str]
    cwd: str
    stdout: Any
    stderr: Any

    @staticmethod
    def capture() -> _CallerState:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        return _CallerState(dict(os.environ), os.getcwd(), _InheritedFd(1), _InheritedFd(2))

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        for fd, target in ((self.stdout, 1), (self.stderr, 2)):
            if fd != target:  # a spawned rank receives the caller's descriptor under its own number
                os.dup2(fd, target)
                os.close(fd)


def _rank_context():
    """Fork server with torch and megatron-core imported where there is no CUDA; spawn otherwise."""
    import torch

    if torch.cuda.is_available() or os.environ.get(RANK_START_ENV) == "spawn":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    # effective once, before the fork server starts (the first call); later calls reuse it
    context.set_forkserver_preload(["gspo_megatron.testing.rank_preload"])
    return context


def _rank_main(rank, world_size, port, fn, args, kwargs, results, threads, caller: _CallerState):
    caller.apply()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        # gloo must not pick a hostname that resolves to an unreachable address.
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    import torch

    torch.set_num_threads(threads)
    try:
        value = fn(RankContext(rank, world_size), *args, **kwargs)
        # Tensors are serialised to bytes: a queue would share them through file descriptors that
        # vanish when this process exits before the parent reads them.
        results.put((rank, True, _to_bytes(value)))
    except BaseException:  # noqa: BLE001 - any failure must reach the caller
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):  # best effort during teardown
                dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    threads_per_rank: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(RankContext, *args, **kwargs)`` on ``world_size`` spawned ranks.

    The environment of each rank carries MASTER_ADDR/PORT, RANK and WORLD_SIZE, so the function can
    call ``torch.distributed.init_process_group("gloo")`` (or the project's layout initialiser).
    Returns the per-rank return values ordered by rank (values must be picklable; move tensors to
    CPU). Raises ``DistributedRunError`` with every failing rank's traceback.
    """
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    caller = _CallerState.capture()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, fn, args, kwargs, results, threads_per_rank, caller),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, tuple[bool, Any]] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedRunError(
                    f"timed out after {timeout:.0f}s; ranks that finished: {sorted(collected)}"
                    + _format_failures(collected)
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
                collected[rank] = (ok, _from_bytes(value) if ok else value)
                if not ok:
                    # One rank failed: its peers are likely blocked in a collective. Give them a
                    # moment to report their own failure, then stop waiting.
                    _drain(results, collected, seconds=3.0)
                    break
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    _drain(results, collected, seconds=1.0)
                    for r in dead:
                        collected.setdefault(r, (False, f"rank {r} exited with code {procs[r].exitcode}"))
                    break
    finally:
        for proc in procs:
            proc.join(timeout=5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
    failures = {r: v for r, (ok, v) in collected.items() if not ok}
    if failures or len(collected) < world_size:
        raise DistributedRunError(f"{len(failures)} of {world_size} ranks failed" + _format_failures(collected))
    return [collected[r][1] for r in range(world_size)]


def _to_bytes(value) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes):
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _drain(results, collected, seconds: float) -> None:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=0.2)
            collected[rank] = (ok, _from_bytes(value) if ok else value)
        except queue.Empty:
            continue


def _format_failures(collected) -> str:
    parts = [f"\n--- rank {r} ---\n{v}" for r, (ok, v) in sorted(collected.items()) if not ok]
    return "".join(parts)
