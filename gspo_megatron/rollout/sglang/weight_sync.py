"""Trainer-side pieces of SGLang weight sync: byte-size buckets, the update group, the broadcaster.

Design decisions:
- Buckets are filled greedily in the order the exporter yields tensors, up to ``bucket_bytes``; a
  tensor larger than a bucket travels alone. One bucket = one ``/update_weights_from_distributed``
  call, so the bucket size trades HTTP round trips against peak extra memory on the servers.
- The trainer is rank 0 of a group it forms with every server rank (server i's TP ranks are
  ``rank_offset .. rank_offset + tp - 1``). ``open_weight_update_group`` builds it exactly the way
  SGLang's ``init_custom_process_group`` does on the other side (TCP rendezvous on the trainer,
  ``PrefixStore(group_name)``, ``_new_process_group_helper``), so store keys match; it is a private
  torch helper, used here because SGLang uses it and the two sides must agree.
- ``WeightBroadcaster`` takes the group as an object (NCCL on GPU, gloo in CPU tests) and broadcasts
  one tensor per name, in order, from rank 0 -- what SGLang's receiver posts one ``broadcast`` per
  (name, dtype, shape) for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

NamedTensor = tuple[str, torch.Tensor]


def bucket_named_tensors(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (an oversize tensor: alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (SGLang resolves it with getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def bucket_metadata(bucket: list[NamedTensor], group_name: str, weight_version: int) -> dict:
    """The JSON body of ``/update_weights_from_distributed`` (SGLang's UpdateWeightsFromDistributedReqInput)."""
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [dtype_name(tensor.dtype) for _, tensor in bucket],
        "shapes": [list(tensor.shape) for _, tensor in bucket],
        "group_name": group_name,
        "flush_cache": False,  # one flush after the last bucket, not one per bucket
        "weight_version": str(weight_version),
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
):
    """Join the trainer<->servers group (blocks until all ``world_size`` ranks joined); returns it."""
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=GroupName(group_name), timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_weight_update_group(group) -> None:
    dist.destroy_process_group(group)


class WeightBroadcaster:
    """Broadcasts buckets from rank ``src`` of ``group`` (the trainer) to the servers."""

    def __init__(self, group, src: int = 0, device: torch.device | str | None = None):
        self.group = group
        self.src = src
        self.device = torch.device(device) if device is not None else None

    def broadcast(self, bucket: list[NamedTensor]) -> None:
        handles = []
        for _, tensor in bucket:
            tensor = tensor.detach()
            if self.device is not None:
                tensor = tensor.to(self.device)
            handles.append(dist.broadcast(tensor.contiguous(), src=self.src, group=self.group, async_op=True))
        for handle in handles:
            handle.wait()
