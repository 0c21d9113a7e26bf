"""The thread rule (core/threads.py): each process's share of the cores less one, halved where the engine
generates beside the trainer, overridden by trainer.cpu_threads and, above it, OMP_NUM_THREADS."""

from __future__ import annotations

import os

import pytest
import torch

from gspo_megatron.core.threads import (
    WORKER_THREAD_ENVS,
    apply_thread_plan,
    plan_threads,
    single_threaded_worker,
    usable_cores,
)


@pytest.mark.parametrize(("cores", "ranks"), [(2, 1), (2, 2), (8, 2), (16, 3), (2, 4)])
def test_ranks_on_one_host_divide_its_cores(cores, ranks):
    plan = plan_threads(cores, ranks, overlap=False, configured=None, environ={})
    assert plan.intra_op == max(1, cores // ranks - 1)  # its share, less one core left to the rest
    assert plan.intra_op * ranks <= max(cores - 1, ranks)  # a core to spare, one thread each at least
    assert f"{cores} core(s) / {ranks} rank(s)" in plan.rule


@pytest.mark.parametrize("cores", [1, 2, 3, 8])
def test_the_engine_and_the_trainer_are_not_both_at_full_width_when_they_overlap(cores):
    beside = plan_threads(cores, 1, overlap=True, configured=None, environ={})
    assert beside.intra_op == max(1, cores // 2)
    assert 2 * beside.intra_op <= max(cores, 2)  # the two threads' teams fit the cores (one each at least)
    assert "embedded engine generates beside the trainer" in beside.rule


def test_the_config_key_overrides_the_rule_and_omp_num_threads_overrides_both():
    configured = plan_threads(2, 1, overlap=True, configured=3, environ={})
    assert (configured.intra_op, configured.from_environment) == (3, False)
    assert configured.rule == "trainer.cpu_threads=3"
    from_env = plan_threads(2, 1, overlap=True, configured=3, environ={"OMP_NUM_THREADS": "2"})
    assert (from_env.intra_op, from_env.from_environment) == (2, True)
    assert "OMP_NUM_THREADS=2 set in the environment" in from_env.rule


@pytest.mark.parametrize("value", ["0", "-1", "two", "4,2"])
def test_an_unusable_omp_num_threads_names_the_variable_and_the_fix(value):
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS=.* is not a positive integer; unset it"):
        plan_threads(2, 1, overlap=False, configured=None, environ={"OMP_NUM_THREADS": value})


def test_applying_a_plan_sets_torch_unless_the_environment_decided():
    before = torch.get_num_threads()  # 1: tests/conftest.py
    apply_thread_plan(plan_threads(usable_cores(), 1, overlap=False, configured=2, environ={}))
    assert torch.get_num_threads() == 2
    apply_thread_plan(plan_threads(usable_cores(), 1, overlap=False, configured=None, environ={"OMP_NUM_THREADS": "3"}))
    assert torch.get_num_threads() == 2  # torch read OMP_NUM_THREADS itself when it started: left alone
    torch.set_num_threads(before)


def test_a_reward_worker_is_single_threaded_unless_omp_num_threads_was_set(monkeypatch):
    for name in WORKER_THREAD_ENVS:
        monkeypatch.delenv(name, raising=False)  # restored after the test, as every variable set below
    torch.set_num_threads(2)  # tests/conftest.py restores the count after the test
    single_threaded_worker()
    assert torch.get_num_threads() == 1
    assert {name: os.environ[name] for name in WORKER_THREAD_ENVS} == dict.fromkeys(WORKER_THREAD_ENVS, "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("MKL_NUM_THREADS")
    torch.set_num_threads(2)
    single_threaded_worker()  # explicit: inherited as it is
    assert torch.get_num_threads() == 2 and "MKL_NUM_THREADS" not in os.environ


def test_only_one_step_asynchronous_rollout_counts_as_the_engine_beside_the_trainer():
    """The rule halved the main job's width although it is synchronous (rollout.max_staleness defaults to 1, read
    without rollout.async_rollout): the engine generates beside the trainer only in one-step async mode."""
    from gspo_megatron.config.compose import compose
    from gspo_megatron.train import engine_generates_beside_training

    assert not engine_generates_beside_training(compose([]))  # the main job: generate, then train
    assert engine_generates_beside_training(compose(["rollout.async_rollout=true"]))
    assert not engine_generates_beside_training(compose(["rollout.async_rollout=true", "rollout.max_staleness=0"]))
