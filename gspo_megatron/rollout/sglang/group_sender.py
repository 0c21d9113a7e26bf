"""One weight sender: a trainer rank that broadcasts buckets to every SGLang server over its own group.

The driver has one (the whole model, or pipeline stage 0's part); with ``weight_senders=per_stage``
each pipeline stage's first rank has one for its own layers (``rollout/sglang/stage_turns.py``).

Design decisions:
- The group is formed on the first bucket and re-formed whenever the set of live servers changes (a
  dead server would otherwise hang every broadcast): the sender is rank 0 (its rendezvous store listens
  on ``sender_address`` only, bound before the servers are told the port), server i's TP ranks follow
  at their offsets (``/init_weights_update_group``).
- Each byte-size bucket is one ``/update_weights_from_distributed`` per server, posted from the loop
  thread while the caller's thread broadcasts the bucket -- the servers' HTTP handlers block until they
  have received it. The HTTP answers and the broadcast are awaited together and the first failure wins:
  a server that refuses a bucket never joins its broadcast, so its 400 is raised at once (with its
  message) and the group is torn down, instead of waiting out the collective timeout.
- A broadcast the servers never join cannot be cancelled on gloo (``weight_sync.py``): a refused bucket
  is abandoned -- the local group aborted (NCCL), the servers' groups destroyed (closes their side), the
  pending operation given ``ABANDONED_BROADCAST_WAIT_S`` to end; one that still has not is parked with
  its group (releasing a gloo group with a pending operation blocks until the group's timeout).
- Memory: the bucket being sent is the only one held (the next is gathered after it has left).
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import socket
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gspo_megatron.core.fp8_blocks import quantize_named_tensors
from gspo_megatron.core.listeners import serve_store
from gspo_megatron.core.named_tensors import NamedTensor
from gspo_megatron.rollout.sglang.auth import ApiKey
from gspo_megatron.rollout.sglang.client import ServerState
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.server_calls import ServerCalls, gather
from gspo_megatron.rollout.sglang.weight_sync import (
    InFlightBroadcast,
    WeightBroadcaster,
    bucket_metadata,
    bucket_named_tensors,
    close_weight_update_group,
    open_weight_update_group,
)

# How long an abandoned broadcast (its bucket refused by a server) may take to end once its group was
# destroyed on the servers; SGLang tears its side down at once, so this is a bound, not a wait.
ABANDONED_BROADCAST_WAIT_S = 10.0


@dataclass(frozen=True)
class SenderBrief:
    """What a pipeline stage's sender needs from the driver for one sync: the live servers, their TP
    sizes (their ranks in each group), whether the tensors go out as block FP8, and the servers' API key
    (``auth.py``; hidden from repr, travels to the stage's rank inside the job's process group)."""

    urls: tuple[str, ...]
    tp_sizes: dict[str, int]
    fp8_block: bool = False
    api_key: ApiKey | None = field(default=None, repr=False)

    def quantized(self, named: Iterable[NamedTensor]) -> Iterable[NamedTensor]:
        return quantize_named_tensors(iter(named)) if self.fp8_block else named


@runtime_checkable
class StagedWeights(Protocol):
    """The trainer's weights when every pipeline stage sends its own layers (``rollout/sglang/stage_turns.py``).

    ``send_by_stages`` runs the stages' turns: stage 0's tensors go through ``send_own`` (the driver's
    sender), the others' from their own ranks; it raises ``StageSyncError`` naming each stage that
    failed once every rank knows. Iterating it is one full export pass (the disk path's)."""

    def send_by_stages(self, brief: SenderBrief, send_own: Callable[[Iterable[NamedTensor]], None]) -> None: ...

    def __iter__(self): ...


class StageSyncError(RuntimeError):
    """At least one pipeline stage's sender failed; no server was moved to the new version."""


def stage_group_name(base: str, stage: int) -> str:
    """The update group of pipeline stage ``stage`` (stage 0 keeps the driver's name)."""
    return base if stage == 0 else f"{base}_stage{stage}"


def stage_master_port(config: SGLangConfig, stage: int) -> int | None:
    """A configured port is the driver's; stage k listens k ports above it (None: a free port)."""
    return None if config.weight_sync_master_port is None else config.weight_sync_master_port + stage


def sender_address(config: SGLangConfig) -> str:
    """The address the servers reach this rank at: the configured one while it is a loopback address
    (one host), else this host's name resolved (a stage's sender runs on its own node)."""
    address = config.weight_sync_master_address
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = address == "localhost"
    return address if loopback else socket.gethostbyname(socket.gethostname())


class GroupSender:
    """Sends named tensors over the update group ``group_name``, whose rank 0 is this process."""

    def __init__(
        self, calls: ServerCalls, config: SGLangConfig, group_name: str, master_address: str, master_port: int | None
    ):
        self.calls = calls
        self.config = config
        self.group_name = group_name
        self.master_address = master_address
        self.master_port = master_port  # None: a free port each time the group is formed
        self._group = None
        self._urls: tuple[str, ...] = ()  # the servers the group was formed with
        self._pending: InFlightBroadcast | None = None  # a bucket on the wire (None between buckets)
        self._parked: list[tuple[Any, InFlightBroadcast]] = []  # abandoned groups whose operation never ended
        self.sent_names: list[str] = []  # what the last ``send`` sent, in order (tests read it)

    def send(
        self, servers: list[ServerState], tp_sizes: dict[str, int], named: Iterable[NamedTensor], version: int | None
    ) -> None:
        """Every tensor of ``named`` into every server of ``servers``, bucket by bucket; ``version``: the
        weight version each bucket sets on the servers (None: set later, once every sender is done)."""
        urls = tuple(server.url for server in servers)
        if self._group is not None and urls != self._urls:
            self.drop()  # a server died or came back: the old group cannot broadcast
        if self._group is None:
            self._urls = urls
            self._group = self._open(servers, tp_sizes)
        broadcaster = WeightBroadcaster(self._group)
        buckets = bucket_named_tensors(named, self.config.weight_bucket_bytes)
        self.sent_names = []
        try:
            for bucket in buckets:
                self._send_bucket(servers, broadcaster, bucket, version)
                self.sent_names += [name for name, _ in bucket]
                del bucket  # dropped before the next bucket is gathered: one bucket is held at a time
        finally:
            buckets.close()  # an abandoned bucket generator would keep its half-filled bucket alive

    def drop(self) -> None:
        """Destroy the group on the servers that are still alive, then locally (a bucket still on the wire
        is ended first: see the module's design notes)."""
        if self._group is None and not self._urls:
            return
        group, urls, pending = self._group, self._urls, self._pending
        self._group, self._urls, self._pending = None, (), None
        if group is not None and pending is not None:
            _abort_locally(group)
        alive = [server for server in self.calls.client.pool.alive() if server.url in urls]
        self.calls.best_effort(alive, "/destroy_weights_update_group", {"group_name": self.group_name})
        if group is None:
            return
        if pending is not None and not pending.finished_within(ABANDONED_BROADCAST_WAIT_S):
            self._parked.append((group, pending))
            warnings.warn(
                f"an abandoned weight broadcast did not end within {ABANDONED_BROADCAST_WAIT_S:.0f}s of destroying "
                f"its group on the servers; the local group is kept until the process exits",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        try:
            close_weight_update_group(group)
        except Exception as error:  # noqa: BLE001 - a half-formed group may refuse; it is dropped anyway
            warnings.warn(f"closing the local weight-update group failed: {error}", RuntimeWarning, stacklevel=2)

    def _send_bucket(self, servers, broadcaster: WeightBroadcaster, bucket, version: int | None) -> None:
        """POST the bucket's metadata to every server while broadcasting it; stop at the first failure."""
        timeout = self.config.weight_sync_timeout_s
        body = bucket_metadata(bucket, self.group_name, version)
        posted = self.calls.loop.submit(self.calls.all(servers, "POST", "/update_weights_from_distributed", body))
        sent = broadcaster.start(bucket)
        self._pending = sent
        concurrent.futures.wait([posted, sent.done], timeout=timeout, return_when=concurrent.futures.FIRST_EXCEPTION)
        refused = posted.exception() if posted.done() else None
        if refused is not None:
            raise refused  # the server's own message
        broken = sent.done.exception() if sent.done.done() else None
        if broken is not None:
            # the collective broke (a server died mid-bucket); its HTTP answer, if any, says why
            concurrent.futures.wait([posted], timeout=ABANDONED_BROADCAST_WAIT_S)
            server = posted.exception() if posted.done() else "no answer"
            raise RuntimeError(f"broadcasting the bucket failed: {broken} (server: {server})")
        if not (posted.done() and sent.done.done()):
            raise TimeoutError(
                f"a weight bucket was not delivered within rollout.sglang.weight_sync_timeout_s={timeout:.0f}s "
                f"(HTTP answered: {posted.done()}, broadcast ended: {sent.done.done()})"
            )
        self._pending = None

    def _open(self, servers, tp_sizes: dict[str, int]):
        config = self.config
        # bound before the servers hear the port: no other process can take it in between
        store = serve_store(self.master_address, self.master_port or 0, config.weight_sync_timeout_s)
        port = store.port
        sizes = [tp_sizes[server.url] for server in servers]
        world_size = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(servers))]
        requests = [
            self.calls.client.call(
                server,
                "POST",
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": port,
                    "rank_offset": offset,
                    "world_size": world_size,
                    "group_name": self.group_name,
                    "backend": config.weight_sync_backend,
                },
            )
            for server, offset in zip(servers, offsets, strict=True)
        ]
        pending = self.calls.loop.submit(gather(requests))
        try:
            group = open_weight_update_group(
                self.master_address,
                port,
                world_size,
                rank=0,
                backend=config.weight_sync_backend,
                group_name=self.group_name,
                timeout_s=config.weight_sync_timeout_s,
                store=store,
            )
        finally:
            pending.result(timeout=config.weight_sync_timeout_s)
        return group


def _abort_locally(group) -> None:
    """Abort a process group's pending operations where the backend can (NCCL); gloo's abort leaves
    them waiting for the peer, which is why the servers' side is destroyed too."""
    try:
        group.abort()
    except Exception as error:  # noqa: BLE001 - best effort: the group is being dropped anyway
        warnings.warn(f"aborting the local weight-update group failed: {error}", RuntimeWarning, stacklevel=2)
