"""Benchmark how the test harness starts ranks: forked from the preloaded fork server vs spawned.

    python tools/bench_rank_start.py                 # 2 ranks, 3 repeats of each, interleaved
    python tools/bench_rank_start.py --ranks 4 --repeats 5

Each repeat calls ``run_distributed`` on a function that joins a gloo group, builds megatron's
parallel state (TP=1) and all-reduces one tensor: what a layout test does before its own work. The two
ways alternate repeat by repeat (GSPO_RANK_START=spawn selects spawning), so machine load hits them
alike; the fork server is started once before the first timed repeat, as it is once per pytest session.
Prints the median and minimum wall time per call and the ratio fork server / spawn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from gspo_megatron.testing.distributed import RANK_START_ENV, run_distributed


def _layout_test_prologue(ctx) -> float:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    value = torch.ones(1)
    dist.all_reduce(value)
    ps.destroy_model_parallel()
    return value.item()


def _timed_call(start: str, ranks: int) -> float:
    if start == "spawn":
        os.environ[RANK_START_ENV] = "spawn"
    else:
        os.environ.pop(RANK_START_ENV, None)
    began = time.perf_counter()
    values = run_distributed(_layout_test_prologue, ranks)
    elapsed = time.perf_counter() - began
    assert values == [float(ranks)] * ranks, values
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    _timed_call("fork server", args.ranks)  # starts the fork server (once per pytest session)
    times: dict[str, list[float]] = {"fork server": [], "spawn": []}
    for _ in range(args.repeats):
        for start in times:
            times[start].append(_timed_call(start, args.ranks))
    for start, values in times.items():
        median, fastest = statistics.median(values), min(values)
        print(f"{start:12s} median {median:6.2f} s   min {fastest:6.2f} s   ({args.ranks} ranks)")
    ratio = statistics.median(times["fork server"]) / statistics.median(times["spawn"])
    print(f"fork server / spawn (median): {ratio:.2f}")


if __name__ == "__main__":
    main()
