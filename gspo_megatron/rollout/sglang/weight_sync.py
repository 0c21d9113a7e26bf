"""Trainer-side pieces of SGLang weight sync: byte-size buckets, the update group, the broadcaster.

Design decisions:
- Buckets (``core/named_tensors.py:bucket_named_tensors``) are filled greedily in the order the exporter
  yields tensors, up to ``bucket_bytes``; a tensor larger than a bucket travels alone. One bucket =
  one ``/update_weights_from_distributed`` call, so the bucket size trades HTTP round trips against
  peak extra memory on the driver and the servers.
- The trainer is rank 0 of a group it forms with every server rank (server i's TP ranks are
  ``rank_offset .. rank_offset + tp - 1``). ``open_weight_update_group`` builds it exactly the way
  SGLang's ``init_custom_process_group`` does on the other side (TCP rendezvous on the trainer,
  ``PrefixStore(group_name)``, ``_new_process_group_helper``), so store keys match; it is a private
  torch helper, used here because SGLang uses it and the two sides must agree. One difference: the
  trainer's rendezvous store listens on ``master_address`` only (``core/listeners.py``; torch's
  ``tcp://`` rendezvous would listen on every interface, and under a launcher that sets
  ``TORCHELASTIC_USE_AGENT_STORE`` it would not serve at all), on a socket bound before the servers
  are told its port (``core/listeners.py: serve_store``).
- ``WeightBroadcaster`` takes the group as an object (NCCL on GPU, gloo in CPU tests) and broadcasts
  one tensor per name, in order, from rank 0 -- what SGLang's receiver posts one ``broadcast`` per
  (name, dtype, shape) for. ``start`` returns at once with an ``InFlightBroadcast`` whose
  ``concurrent.futures.Future`` completes when every tensor has left (or fails with the collective's
  error), so the engine can wait on the broadcast and the server's HTTP answer together and stop at
  whichever fails first.
- A broadcast the servers never join cannot be cancelled on gloo (``ProcessGroupGloo.abort`` leaves
  the pending operation waiting for its peer; only the peer closing its side or the group timeout
  ends it), and dropping the last reference to a group with a pending operation blocks until it ends.
  So a refused bucket is abandoned, not awaited: the engine destroys the group on the servers (which
  closes their side), aborts the local group (which cancels NCCL operations), and waits a bounded
  time for the pending operation to end before it releases the group.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gspo_megatron.core.listeners import serve_store
from gspo_megatron.core.named_tensors import NamedTensor
from gspo_megatron.core.named_tensors import bucket_named_tensors as bucket_named_tensors  # the engine's buckets


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (SGLang resolves it with getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def bucket_metadata(bucket: list[NamedTensor], group_name: str, weight_version: int | None) -> dict:
    """The JSON body of ``/update_weights_from_distributed`` (SGLang's UpdateWeightsFromDistributedReqInput);
    ``weight_version`` None leaves the servers' version as it is (SGLang's default)."""
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [dtype_name(tensor.dtype) for _, tensor in bucket],
        "shapes": [list(tensor.shape) for _, tensor in bucket],
        "group_name": group_name,
        "flush_cache": False,  # one flush after the last bucket, not one per bucket
        "weight_version": None if weight_version is None else str(weight_version),
    }


def open_weight_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    rank: int = 0,
    backend: str = "nccl",
    group_name: str = "weight_update_group",
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
):
    """Join the trainer<->servers group (blocks until all ``world_size`` ranks joined); returns it.

    Rank 0 serves the rendezvous store on ``master_address`` only (or uses ``store``, from
    ``serve_store``); the other ranks dial it."""
    from torch.distributed.distributed_c10d import Backend, GroupName, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    if store is None and rank == 0:
        store = serve_store(master_address, master_port, timeout_s)
    elif store is None:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=GroupName(group_name), timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_weight_update_group(group) -> None:
    dist.destroy_process_group(group)


@dataclass
class InFlightBroadcast:
    """One bucket on the wire: ``done`` completes when all its tensors were sent, or fails with the
    collective's error. ``tensors`` keeps the sent tensors alive until then (the collective reads them)."""

    done: concurrent.futures.Future
    tensors: list[torch.Tensor]

    def finished_within(self, timeout_s: float) -> bool:
        """True when the broadcast ended (sent or failed) within ``timeout_s``."""
        concurrent.futures.wait([self.done], timeout=timeout_s)
        return self.done.done()


class WeightBroadcaster:
    """Broadcasts buckets from rank ``src`` of ``group`` (the trainer) to the servers."""

    def __init__(self, group, src: int = 0, device: torch.device | str | None = None):
        self.group = group
        self.src = src
        self.device = torch.device(device) if device is not None else None

    def start(self, bucket: list[NamedTensor]) -> InFlightBroadcast:
        """Post one broadcast per tensor (asynchronous); returns at once."""
        tensors, futures = [], []
        for _, tensor in bucket:
            tensor = tensor.detach()
            if self.device is not None:
                tensor = tensor.to(self.device)
            tensor = tensor.contiguous()
            work = dist.broadcast(tensor, src=self.src, group=self.group, async_op=True)
            assert work is not None  # async_op=True always returns its Work (torch 2.15 types it Optional)
            tensors.append(tensor)
            futures.append(work.get_future())
        done: concurrent.futures.Future = concurrent.futures.Future()

        def settle(all_sent) -> None:  # runs on the backend's thread when the last future ends
            try:
                all_sent.wait()  # raises the first operation's error
            except Exception as error:  # noqa: BLE001 - handed to the waiter
                done.set_exception(error)
            else:
                done.set_result(None)

        torch.futures.collect_all(futures).add_done_callback(settle)
        return InFlightBroadcast(done, tensors)

    def broadcast(self, bucket: list[NamedTensor]) -> None:
        """Send one bucket and wait until it has left."""
        self.start(bucket).done.result()
