"""Count the bytes a rank hands to torch.distributed collectives, by process group and collective.

``count_collectives(groups)`` patches, for the duration of a ``with`` block, the torch.distributed
entry points megatron-core and this project call (``all_reduce``, ``all_gather``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``,
``batch_isend_irecv``) and the module-level aliases megatron binds at import
(``dist_all_gather_func`` / ``dist_reduce_scatter_func``). Each call still runs; its *payload* (the
gathered output of an all-gather, the input of a reduce-scatter or all-reduce, each send and receive
buffer of a point-to-point batch) is added under (group name, collective). Groups are named by
identity from the mapping given (first match wins); any other group of more than one rank is
recorded as ``other:<ranks>``, so nothing is silently dropped. Calls on single-rank groups move no
bytes and are not counted (the planner's ``comm.Traffic`` skips them the same way).
"""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.distributed as dist

_MEGATRON_ALIASES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.utils",
)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CollectiveCounter:
    def __init__(self, groups: dict):
        self.groups = groups
        self.payload: dict[tuple[str, str], int] = {}

    def name_of(self, group) -> str | None:
        group = group if group is not None else dist.group.WORLD
        if dist.get_world_size(group) <= 1:
            return None
        for name, candidate in self.groups.items():
            if candidate is group:
                return name
        return "other:" + ",".join(map(str, dist.get_process_group_ranks(group)))

    def add(self, group, collective: str, nbytes: int) -> None:
        name = self.name_of(group)
        if name is not None:
            self.payload[(name, collective)] = self.payload.get((name, collective), 0) + nbytes


@contextlib.contextmanager
def count_collectives(groups: dict):
    counter = CollectiveCounter(groups)
    originals = {
        name: getattr(dist, name)
        for name in (
            "all_reduce",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_to_all_single",
            "broadcast",
            "batch_isend_irecv",
        )
    }

    def all_reduce(tensor, *a, group=None, **k):
        counter.add(group, "all_reduce", _bytes(tensor))
        return originals["all_reduce"](tensor, *a, group=group, **k)

    def all_gather(tensor_list, tensor, group=None, **k):
        counter.add(group, "all_gather", sum(_bytes(t) for t in tensor_list))
        return originals["all_gather"](tensor_list, tensor, group=group, **k)

    def all_gather_into_tensor(output, input_, group=None, **k):
        counter.add(group, "all_gather", _bytes(output))
        return originals["all_gather_into_tensor"](output, input_, group=group, **k)

    def reduce_scatter_tensor(output, input_, *a, group=None, **k):
        counter.add(group, "reduce_scatter", _bytes(input_))
        return originals["reduce_scatter_tensor"](output, input_, *a, group=group, **k)

    def all_to_all_single(output, input_, *a, group=None, **k):
        counter.add(group, "all_to_all", _bytes(input_))
        return originals["all_to_all_single"](output, input_, *a, group=group, **k)

    def broadcast(tensor, *a, group=None, **k):
        counter.add(group, "broadcast", _bytes(tensor))
        return originals["broadcast"](tensor, *a, group=group, **k)

    def batch_isend_irecv(ops):
        for op in ops:
            counter.add(op.group, "send_recv", _bytes(op.tensor))
        return originals["batch_isend_irecv"](ops)

    patched = dict(
        all_reduce=all_reduce,
        all_gather=all_gather,
        all_gather_into_tensor=all_gather_into_tensor,
        reduce_scatter_tensor=reduce_scatter_tensor,
        all_to_all_single=all_to_all_single,
        broadcast=broadcast,
        batch_isend_irecv=batch_isend_irecv,
    )
    aliases = []
    for module_name in _MEGATRON_ALIASES:
        module = importlib.import_module(module_name)
        for alias, replacement in (
            ("dist_all_gather_func", all_gather_into_tensor),
            ("dist_reduce_scatter_func", reduce_scatter_tensor),
        ):
            if hasattr(module, alias):
                aliases.append((module, alias, getattr(module, alias)))
                setattr(module, alias, replacement)
    for name, fn in patched.items():
        setattr(dist, name, fn)
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for module, alias, fn in aliases:
            setattr(module, alias, fn)
