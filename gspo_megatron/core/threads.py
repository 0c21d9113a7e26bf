"""How many CPU threads each part of a run computes with: one stated rule, applied once at start-up.

The rule, for the torch intra-op threads of a training process (``plan_threads``):

    share    = max(1, cores // ranks_on_this_host)     cores: os.sched_getaffinity (what this process may use);
                                                        ranks_on_this_host: LOCAL_WORLD_SIZE (1 without a launcher)
    overlap  = this process generates while it trains:  the driver, rollout.engine=embedded, rollout.async_rollout
                                                        with rollout.max_staleness >= 1 (train.py)
    intra_op = max(1, share // 2) if overlap else max(1, share - 1)

- Ranks on one host divide its cores, and each leaves one core of its share to the rest of the machine
  (reward workers, the data path, the OS, whoever else shares it): torch's OpenMP team waits at every
  parallel region for its slowest thread, so a team as wide as the cores runs at the speed of a thread
  that another process has pushed off its core. Measured on 2 cores, the main job (200 steps,
  ``tools/bench_threads.py``, docs/benchmarks.md "Threads"): 1 thread 39-48 s in every repetition; 2 threads
  35-49 s while the machine was otherwise quiet, 77-176 s while a test process shared it.
- The embedded engine and the trainer are not both at full width when they run at the same time: with
  one-step asynchronous rollout (``rollout/scheduler.py``) the driver's engine generates step k+1 in a
  background thread while its main thread trains step k, and torch gives that thread the process's
  width too (a new thread takes the count ``torch.set_num_threads`` stored); each gets half the share.
  A synchronous run (the main job: ``rollout.async_rollout=false``), an SGLang engine (its own processes)
  and the other ranks (no engine) run one thing at a time: the whole share.
- Reward worker processes compute with one thread each (``single_threaded_worker``, called by
  ``rollout/rewards/pool.py``'s workers): they are many, they score strings, and they run while the
  engine waits for them.

Overrides, strongest first: ``OMP_NUM_THREADS`` set in the environment (as a user sets it, or torchrun does
-- 1 per process where several share a host and it is unset -- and as every test runs); it then also
reaches the reward workers and this module does not touch torch's count at all, so a run keeps exactly
the thread count, and the numbers, it had before this rule existed. Then ``trainer.cpu_threads``. Then
the rule.

Design decisions:
- CPU float results can depend on the thread count (a reduction split over more threads adds in
  another order); a run's width is therefore logged at start-up (``threads: N intra-op (...)``) and
  recorded with the config in the run directory (``cpu_threads``, ``loop/trainer.py``), and the override
  keeps any older run reproducible.
- The rule, not a measured optimum: ``tools/bench_threads.py`` times the main job under the default
  and every ``OMP_NUM_THREADS`` from 1 to the cores; docs/benchmarks.md holds its table.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

THREADS_ENV = "OMP_NUM_THREADS"
# the thread-count variables of the math libraries a reward worker may load after it starts
WORKER_THREAD_ENVS = (THREADS_ENV, "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class ThreadPlan:
    """A process's torch intra-op thread count, and the reason in words (for the start-up log)."""

    intra_op: int
    rule: str
    from_environment: bool = False  # OMP_NUM_THREADS set: torch already reads it, nothing to apply


def explicit_threads(environ: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` as a positive integer, or None when it is unset."""
    value = environ.get(THREADS_ENV)
    if value is None or value.strip() == "":
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(
            f"{THREADS_ENV}={value!r} in the environment is not a positive integer; unset it (the rule in "
            f"gspo_megatron/core/threads.py decides) or set e.g. {THREADS_ENV}=2"
        )
    return count


def plan_threads(
    cores: int, local_ranks: int, overlap: bool, configured: int | None, environ: Mapping[str, str]
) -> ThreadPlan:
    """The module docstring's rule: ``OMP_NUM_THREADS``, else ``configured`` (trainer.cpu_threads), else
    the process's share of ``cores`` among ``local_ranks``, halved where the engine generates beside
    the trainer (``overlap``)."""
    from_env = explicit_threads(environ)
    if from_env is not None:
        return ThreadPlan(from_env, f"{THREADS_ENV}={from_env} set in the environment", from_environment=True)
    if configured is not None:
        return ThreadPlan(configured, f"trainer.cpu_threads={configured}")
    share = max(1, cores // max(1, local_ranks))
    rule = f"rule: {cores} core(s) / {local_ranks} rank(s) on this host = {share}"
    if not overlap:
        width = max(1, share - 1)
        return ThreadPlan(width, rule if width == share else f"{rule}, one left to the rest of the machine: {width}")
    width = max(1, share // 2)
    return ThreadPlan(width, f"{rule}, halved to {width}: the embedded engine generates beside the trainer")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under taskset or a container's cpuset)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def apply_thread_plan(plan: ThreadPlan) -> None:
    """Set torch's intra-op count; with ``OMP_NUM_THREADS`` set torch already uses it and is left alone."""
    if plan.from_environment:
        return
    import torch

    torch.set_num_threads(plan.intra_op)


def single_threaded_worker() -> None:
    """A reward worker's rule: one thread, unless ``OMP_NUM_THREADS`` was set explicitly (then it is
    inherited as it is). The variables reach libraries the verifier loads later; torch, already
    imported by a fork server's preload, is set directly."""
    if explicit_threads(os.environ) is not None:
        return
    for name in WORKER_THREAD_ENVS:
        os.environ[name] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
