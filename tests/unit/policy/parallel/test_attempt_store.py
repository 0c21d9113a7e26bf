"""A restarted attempt's ranks meet in a store of their own, never at the dead attempt's addresses."""

from __future__ import annotations

import socket
import threading

import pytest

from gspo_megatron.core.listeners import serve_store
from gspo_megatron.policy.parallel.attempt_store import (
    ANNOUNCEMENT,
    AttemptStoreError,
    _connect_if_fresh,
    open_attempt_store,
    restarts_possible,
)
from gspo_megatron.testing.listeners import listening_addresses, non_loopback_ipv4, reachable


@pytest.fixture
def agent_store():
    """What torchrun's agent serves: one store for every attempt (here on loopback only)."""
    yield serve_store("127.0.0.1", 0, timeout_s=10)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}, True),
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}, False),  # no restart
        ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, False),  # the project's launcher: never restarts
        ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"}, False),  # rank 0 serves
        ({}, False),
    ],
)
def test_restarts_possible(env, expected):
    assert restarts_possible(env) is expected


def test_a_stale_announcement_is_passed_over_until_rank_0_of_this_attempt_writes(agent_store):
    port = agent_store.port
    agent_store.set(ANNOUNCEMENT, f"127.0.0.1 {_closed_port()} nonce-of-the-dead-attempt")
    found = {}
    rank_1 = threading.Thread(target=lambda: found.update(store=open_attempt_store(1, "127.0.0.1", port, 30)))
    rank_1.start()  # reads the stale announcement: nothing listens there; it reads again
    rank_0 = open_attempt_store(0, "127.0.0.1", port, 30)
    rank_1.join(timeout=60)
    assert not rank_1.is_alive()
    assert found["store"].port == rank_0.port != port
    rank_0.store.set("written by rank 0", "seen by rank 1")
    assert found["store"].store.get("written by rank 0") == b"seen by rank 1"


def test_a_live_store_without_this_attempts_nonce_is_not_taken(agent_store):
    other = serve_store("127.0.0.1", 0, timeout_s=10)
    assert _connect_if_fresh("127.0.0.1", other.port, "nonce", 10) is None  # someone else's store now
    assert _connect_if_fresh("127.0.0.1", _closed_port(), "nonce", 10) is None  # the dead rank 0's
    rank_0 = open_attempt_store(0, "127.0.0.1", agent_store.port, 10)
    nonce = agent_store.get(ANNOUNCEMENT).decode().split()[2]
    assert _connect_if_fresh("127.0.0.1", rank_0.port, nonce, 10) is not None


def test_no_announcement_from_this_attempt_fails_within_the_timeout_naming_rank_0(agent_store):
    agent_store.set(ANNOUNCEMENT, f"127.0.0.1 {_closed_port()} nonce-of-the-dead-attempt")
    with pytest.raises(AttemptStoreError, match="rank 0 of this attempt did not announce its store"):
        open_attempt_store(1, "127.0.0.1", agent_store.port, 1.0)


def test_rank_0_serves_this_attempts_store_on_the_agents_address_only(agent_store):
    """issue 63: the attempt's store listened, unauthenticated, on every interface."""
    rank_0 = open_attempt_store(0, "127.0.0.1", agent_store.port, 10)
    assert listening_addresses(rank_0.port) == {"127.0.0.1"}
    assert agent_store.get(ANNOUNCEMENT).decode().split()[:2] == ["127.0.0.1", str(rank_0.port)]
    other = non_loopback_ipv4()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    assert not reachable(other, rank_0.port), f"this attempt's store answered on {other}:{rank_0.port}"
