"""The multi-rank test harness: results come back per rank, failures name their rank."""

import pytest
import torch
import torch.distributed as dist

from gspo_megatron.testing.distributed import DistributedRunError, run_distributed

pytestmark = pytest.mark.distributed


def _all_reduce_rank(ctx, offset):
    dist.init_process_group("gloo")
    value = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(value)
    return ctx.rank, value.item()


def _fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one is broken")
    return ctx.rank


def test_results_come_back_in_rank_order():
    results = run_distributed(_all_reduce_rank, 3, 10)
    assert results == [(0, 33.0), (1, 33.0), (2, 33.0)]


def test_failure_names_the_rank_and_cause():
    with pytest.raises(DistributedRunError, match=r"(?s)rank 1.*rank one is broken"):
        run_distributed(_fail_on_rank_one, 2)


def _what_the_rank_inherited(ctx):
    import os
    import sys

    import megatron.core.parallel_state as ps

    print(f"rank {ctx.rank} says hello", flush=True)
    print(f"rank {ctx.rank} warns", file=sys.stderr, flush=True)
    return (
        os.environ.get("GSPO_HARNESS_PROBE"),
        os.getcwd(),
        ps.model_parallel_is_initialized(),
        os.getpid(),
    )


@pytest.mark.parametrize("start", ["fork server", "spawn"])
def test_a_rank_gets_the_callers_environment_directory_and_output(start, tmp_path, monkeypatch, capfd):
    """Forked from the preloaded fork server or spawned, a rank sees what the caller set just before
    the call (environment, working directory), writes where the caller's output goes, and starts with
    no state from an earlier call (megatron's parallel state uninitialised, its own process)."""
    if start == "spawn":
        monkeypatch.setenv("GSPO_RANK_START", "spawn")
    run_distributed(_what_the_rank_inherited, 2)  # the fork server runs before the test changes anything
    capfd.readouterr()
    monkeypatch.setenv("GSPO_HARNESS_PROBE", f"set by the test ({start})")
    monkeypatch.chdir(tmp_path)
    first = run_distributed(_what_the_rank_inherited, 2)
    second = run_distributed(_what_the_rank_inherited, 2)
    for env, cwd, initialised, _ in first + second:
        assert env == f"set by the test ({start})"
        assert cwd == str(tmp_path)
        assert initialised is False
    assert len({pid for *_, pid in first + second}) == 4
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert out.count(f"rank {rank} says hello") == 2
        assert err.count(f"rank {rank} warns") == 2
