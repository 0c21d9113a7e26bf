"""The heartbeat names the rank whose beat stopped, and parallel.timeout_s is checked at start-up."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from gspo_megatron.policy.config import ParallelSection
from gspo_megatron.policy.parallel.heartbeat import Heartbeat, is_collective_failure


@pytest.fixture
def store_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    server = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=10),
        master_listen_fd=sock.detach(),  # the store owns (and closes) the socket from here
        use_libuv=True,
    )
    yield port
    del server


def test_the_rank_that_stopped_beating_is_named(store_port):
    beats = [Heartbeat(rank, 3, "127.0.0.1", store_port, interval_s=0.05) for rank in range(3)]
    try:
        beats[0].enter("step 4, update")
        beats[2].enter("step 4, rollout")
        beats[2].wait_for_beats(2)
        beats[2].close()  # rank 2 goes silent, as a stopped process does
        silent = beats[0].silent_ranks()
        assert silent == {2: "step 4, rollout"}
        message = beats[0].explain(RuntimeError("Timed out waiting 15000ms for recv operation"), 15)
        assert message.startswith("rank 0: a collective failed in step 4, update (parallel.timeout_s=15)")
        assert "silent: rank 2 (last seen in step 4, rollout)" in message
    finally:
        for beat in beats:
            beat.close()


class _SlowWrites:
    """The rendezvous store with a write that is still in flight when the test reads (CI: a loaded
    machine). Before the fix the beat was counted before its write, so wait_for_beats returned while
    the store still held the old phase."""

    def __init__(self, store):
        self._store = store
        self.writing = threading.Event()
        self.release = threading.Event()

    def set(self, key, value):
        self.writing.set()
        self.release.wait(30)  # until the test has read (the fixed code waits here for the write)
        self._store.set(key, value)


def test_a_new_phase_is_published_at_once_not_at_the_next_beat(store_port):
    """A rank stopped right after it entered a phase is reported in that phase (CI: a SIGSTOP within
    one interval of step 1 named the rank's start-up, the last phase a periodic beat had published)."""
    watcher, beat = (Heartbeat(rank, 2, "127.0.0.1", store_port, interval_s=3600.0) for rank in range(2))
    try:
        beat.wait_for_beats(1)
        beat._store = slow = _SlowWrites(beat._store)
        beat.enter("step 1, rollout")
        assert slow.writing.wait(30), "entering a phase did not start a beat"
        threading.Timer(1.0, slow.release.set).start()  # only bounds the old code's wait; no result rests on it
        assert beat.wait_for_beats(2), "entering a phase did not publish a beat"
        assert watcher._read()[1] == (2, "step 1, rollout")
    finally:
        watcher.close()
        beat.close()


def test_collective_failures_are_recognised():
    assert is_collective_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:21210"))
    assert is_collective_failure(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"))
    assert is_collective_failure(RuntimeError("Application timeout caused pair closure"))  # gloo's other wording
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))
    assert not is_collective_failure(ValueError("Timed out waiting"))


@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan")])
def test_parallel_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match=r"parallel.timeout_s=.* must be > 0"):
        ParallelSection(timeout_s=bad)
