"""Several trainings in one process (a Hydra multirun, a test session): each run's model, gradient
buffers and process groups are freed when it ends (``ModelChunks.release``, called by ``Policy.close``)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import FAST

pytestmark = pytest.mark.e2e

TASKS = Path("/proc/self/task")
# the threads a gloo process group runs: its device's event loop and its worker threads
GLOO_THREADS = {"gloo_tcp_loop", "pt_gloo_runloop"}


def gloo_threads() -> int:
    return sum((task / "comm").read_text().strip() in GLOO_THREADS for task in TASKS.iterdir())


def runs_in_one_process(ctx, overrides: list[str], run_dir: str, runs: int) -> list[tuple[int, int]]:
    """(gloo threads, live megatron DDP wrappers) after each of ``runs`` trainings in this rank's process."""
    from megatron.core.distributed import DistributedDataParallel

    from gspo_megatron.config.compose import compose
    from gspo_megatron.train import run

    after = []
    for index in range(runs):
        run(compose(overrides), f"{run_dir}/run{index}")
        gc.collect()
        live = sum(isinstance(obj, DistributedDataParallel) for obj in gc.get_objects())
        after.append((gloo_threads(), live))
    return after


@pytest.mark.skipif(not TASKS.is_dir(), reason="counts threads through /proc (Linux)")
def test_a_finished_run_frees_its_model_and_process_groups(tmp_path):
    (after,) = run_distributed(runs_in_one_process, 1, FAST, str(tmp_path), 3, timeout=600)
    assert [live for _, live in after] == [0, 0, 0], after  # no run's DDP wrapper outlives it
    threads = [count for count, _ in after]
    assert threads[2] == threads[1] == threads[0], after  # nor its process groups' threads
