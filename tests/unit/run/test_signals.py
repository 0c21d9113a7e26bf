"""SignalWatch: the first signal is recorded for the trainer, the second interrupts at once."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from gspo_megatron.loop.trainer import TrainingInterrupted
from gspo_megatron.run.signals import SignalWatch


def test_first_signal_is_recorded_second_interrupts():
    before = signal.getsignal(signal.SIGTERM)
    with SignalWatch(grace_s=60) as watch:
        assert watch.agreed_signal() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.agreed_signal() == signal.SIGTERM
        with pytest.raises(TrainingInterrupted, match="SIGTERM received twice") as stop:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_first_signal_abandons_a_step_that_does_not_end_within_the_grace():
    """Issue 63, item 6: after the first SIGTERM a step stuck in a wait ran on without a bound."""
    with SignalWatch(grace_s=0.2) as watch:
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.signum == signal.SIGTERM
        with pytest.raises(TrainingInterrupted, match="did not end within checkpoint.signal_grace_s=0.2 s") as stop:
            threading.Event().wait(60)  # a wait that never ends by itself: only the grace timer's SIGALRM ends it
        assert stop.value.exit_code == 143
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_step_that_ends_disarms_the_grace_so_the_save_is_not_cut_short():
    before = signal.getsignal(signal.SIGALRM)
    with SignalWatch(grace_s=30) as watch:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
        assert watch.agreed_signal() == signal.SIGTERM  # between steps: the step ended
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


GLOO_WAIT = """
import sys, threading
from datetime import timedelta
import torch, torch.distributed as dist
from gspo_megatron.run.signals import SignalWatch
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=600)
)
if rank == 1:
    threading.Event().wait(600)  # joined, never sends
else:
    with SignalWatch(grace_s=5, unwind_s=0.5):
        print("waiting", flush=True)
        dist.recv(torch.zeros(1), src=1)  # a wait inside C++: Python's handlers cannot run until it returns
"""


def _wait_until_blocked(pid: int, bound_s: float = 60.0) -> None:
    """Until ``pid``'s main thread sleeps in the kernel (state S: blocked in the collective's wait), bounded."""
    import time

    stat = f"/proc/{pid}/task/{pid}/stat"
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        with open(stat) as handle:
            if handle.read().rsplit(")", 1)[1].split()[0] == "S":
                return
        time.sleep(0.05)
    raise AssertionError(f"rank 0 never blocked within {bound_s} s")


@pytest.mark.slow
def test_a_stop_stuck_in_a_collective_ends_the_process_with_128_plus_the_signal(tmp_path):
    """Issue 63, item 6: a SIGTERM while the main thread waits inside a gloo collective (a distributed weight
    sync to a stuck server) ran no handler until the collective's own timeout (weight_sync_timeout_s, 600 s).
    The watch's timer thread ends the process once the grace and the unwind time have passed."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_WAIT, str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        assert ranks[0].stdout.readline() == "waiting\n"  # printed just before the wait's call
        _wait_until_blocked(ranks[0].pid)  # the signal then arrives while the main thread waits inside C++
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(timeout=120) == 143
        assert "exiting now with 143" in ranks[0].stderr.read()
    finally:
        for process in ranks:
            process.kill()
            process.wait()


def test_stop_message_names_the_checkpoint_a_scheduled_save_wrote(tmp_path):
    """D18: with checkpoint.save_on_signal=false a step that saved on schedule said 'no checkpoint written'."""
    from gspo_megatron.loop.trainer import signal_stop_outcome

    saved = tmp_path / "checkpoints" / "step_000004"
    assert signal_stop_outcome(saved, saved) == f"checkpoint {saved}; continue with checkpoint.resume=true"
    earlier = tmp_path / "checkpoints" / "step_000002"
    assert signal_stop_outcome(None, earlier) == (
        "no checkpoint written for this step (checkpoint.save_on_signal=false); "
        f"checkpoint.resume=true continues from {earlier}"
    )
    assert signal_stop_outcome(None, None).endswith("there is no checkpoint to resume")


class _SignalledExport:
    """A weight stream (re-iterable, as the trainer's export) whose first pass receives SIGTERM twice
    after its first tensor: the second signal's handler raises in the middle of the sync."""

    def __init__(self):
        self.passes = 0

    def __iter__(self):
        import torch

        self.passes += 1
        yield "w", torch.ones(2)
        if self.passes == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises TrainingInterrupted here
        yield "v", torch.ones(3)


def test_a_second_signal_during_a_weight_sync_exits_143_not_1(tmp_path):
    """Issue 63, item 6: the weight sync took the handler's TrainingInterrupted for a failure of its own and
    wrapped it in WeightSyncError (a distributed sync also retried it through the disk path), so the run
    exited 1. It is raised as it is (exit 143), and the server is told to continue."""
    from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
    from gspo_megatron.testing.sglang_double import SGLangServerDouble

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = SGLangConfig(
        mode="attach", weight_sync="disk", model_path=str(model), disk_sync_dir=str(tmp_path / "sync")
    )
    with SGLangServerDouble() as double:
        config.urls = [double.url]
        with SGLangEngine(config) as engine, SignalWatch(grace_s=60):
            with pytest.raises(TrainingInterrupted, match="SIGTERM received twice") as stop:
                engine.update_weights(_SignalledExport(), version=1)
            assert stop.value.exit_code == 143 and engine.weight_version == 0
        paths = double.paths()
    assert "/update_weights_from_disk" not in paths and paths.count("/continue_generation") == 1


class _OneSignalExport(_SignalledExport):
    """A weight stream that receives SIGTERM once after its first tensor (the run is told to stop once)."""

    def __iter__(self):
        import torch

        self.passes += 1
        yield "w", torch.ones(2)
        if self.passes == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        yield "v", torch.ones(3)


def test_one_signal_during_a_weight_sync_whose_server_never_answers_stops_within_the_grace(tmp_path):
    """Issue 63, item 6: SIGTERM during a stuck weight sync left the run alive (90 s later and on, until the
    request timeout and its retries ran out). The step is abandoned within checkpoint.signal_grace_s and the
    run exits 143; the engine keeps its weight version (no update counted)."""
    from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
    from gspo_megatron.testing.sglang_double import SGLangServerDouble
    from gspo_megatron.testing.sglang_double_faults import DoubleFaults

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = SGLangConfig(
        mode="attach",
        weight_sync="disk",
        model_path=str(model),
        disk_sync_dir=str(tmp_path / "sync"),
        request_timeout_s=600.0,
    )
    with SGLangServerDouble(faults=DoubleFaults(disk_update_never_answers=True)) as double:
        config.urls = [double.url]
        with SGLangEngine(config) as engine, SignalWatch(grace_s=0.5):
            with pytest.raises(TrainingInterrupted, match="did not end within checkpoint.signal_grace_s") as stop:
                engine.update_weights(_OneSignalExport(), version=1)
            assert stop.value.exit_code == 143 and engine.weight_version == 0
