"""A rendezvous store of each attempt's own when torchrun may restart the ranks (issue 48).

torchrun's c10d rendezvous serves one TCPStore from its agent for the whole job and hands it to every
attempt (``TORCHELASTIC_USE_AGENT_STORE=True``). The keys the process groups wrote in a failed attempt
are still there after the restart, so the restarted gloo/NCCL groups read the dead ranks' addresses
and fail at once (``Gloo connectFullMesh failed ... Connection refused``; pytorch issues 135712 and
167288). ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: an agent whose own workers were
healthy restarts them without counting, so the nodes disagree.

Here rank 0 of every attempt serves a fresh TCPStore and announces ``host port nonce`` in the agent's
store. The store listens on one address only (``core/listeners.py``; torch's own would listen on every
interface): the one rank 0 reaches the agent's store from, which is this node's address on the job's
network (127.0.0.1 when the agent's store is on loopback), and that is the ``host`` announced.

Every other rank reads the announcement and accepts it only when the store it names answers and holds
the same nonce: a stale announcement names the dead rank 0's store (nothing listens: the connection is
refused) or a port another process holds now (no such nonce), and the rank reads again until this
attempt's rank 0 has written it, within the collective timeout.

Used only when restarts are possible (``TORCHELASTIC_MAX_RESTARTS`` > 0): otherwise the ranks meet in
the store they were given (torchrun's, or the project launcher's loopback-only one).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from gspo_megatron.core.listeners import serve_store

ANNOUNCEMENT = "gspo_attempt_store"  # key in the agent's store: "host port nonce"
NONCE_KEY = "gspo_attempt_nonce"  # key in this attempt's store
RETRY_S = 0.2
CONNECT_TIMEOUT_S = 5.0


class AttemptStoreError(RuntimeError):
    pass


@dataclass(frozen=True)
class AttemptStore:
    store: dist.TCPStore  # this attempt's rendezvous store (process groups, heartbeat); rank 0's serves
    host: str
    port: int


def restarts_possible(env: Mapping[str, str] | None = None) -> bool:
    """torchrun may start this job's ranks again (``--max-restarts`` > 0), in the store it shares."""
    variables: Mapping[str, str] = os.environ if env is None else env
    shared = variables.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return shared and int(variables.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def open_attempt_store(rank: int, host: str, port: int, timeout_s: float) -> AttemptStore:
    """Rank 0 serves this attempt's store; the others find it through the agent's store at host:port."""
    agent = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    if rank == 0:
        own_host = address_towards(host, port)
        server = serve_store(own_host, 0, timeout_s)
        nonce = secrets.token_hex(16)
        server.set(NONCE_KEY, nonce)
        agent.set(ANNOUNCEMENT, f"{own_host} {server.port} {nonce}")
        return AttemptStore(store=server, host=own_host, port=server.port)
    deadline = time.monotonic() + timeout_s
    while True:
        own_host, own_port, nonce = agent.get(ANNOUNCEMENT).decode().split()
        client = _connect_if_fresh(own_host, int(own_port), nonce, timeout_s)
        if client is not None:
            return AttemptStore(store=client, host=own_host, port=int(own_port))
        if time.monotonic() > deadline:
            raise AttemptStoreError(
                f"rank {rank}: rank 0 of this attempt did not announce its store in {timeout_s:g} s "
                f"(agent store {host}:{port}); is rank 0 running? (parallel.timeout_s bounds this wait)"
            )
        time.sleep(RETRY_S)


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host:port`` (the local end of a connection to it)."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as probe:
            return probe.getsockname()[0]
    except OSError as error:
        raise AttemptStoreError(f"rank 0: cannot reach the agent's store at {host}:{port} ({error})") from None


def _connect_if_fresh(host: str, port: int, nonce: str, timeout_s: float) -> dist.TCPStore | None:
    """A client of the store at host:port if it is this attempt's (holds ``nonce``), else None.
    A plain socket probes first: TCPStore's own connect retries and logs every refusal."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError:
        return None  # the previous attempt's rank 0 is gone
    try:
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT_S))
        fresh = client.check([NONCE_KEY]) and client.get(NONCE_KEY).decode() == nonce
    except (RuntimeError, ValueError):  # not a TCPStore (someone else's port now)
        return None
    if not fresh:
        return None
    client.set_timeout(timedelta(seconds=timeout_s))
    return client
