"""Initialise torch.distributed and megatron-core's parallel state from a ParallelLayout.

``ParallelMesh`` is the one object call sites ask for process groups and ranks. It is created once
by the trainer (or a test) and passed along; nothing reads a global to find it. It wraps
megatron-core's ``parallel_state`` because megatron's modules read their groups from there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from gspo_megatron.policy.cpu_bridges import cpu_megatron_enabled
from gspo_megatron.policy.parallel.attempt_store import AttemptStore, open_attempt_store, restarts_possible
from gspo_megatron.policy.parallel.device import compute_device, cuda_kernels
from gspo_megatron.policy.parallel.heartbeat import Heartbeat
from gspo_megatron.policy.parallel.layout import LayoutError, ParallelLayout

T = TypeVar("T")


@dataclass
class ParallelMesh:
    layout: ParallelLayout
    device: torch.device
    timeout_s: float = 600.0  # every collective's bound (parallel.timeout_s)
    heartbeat: Heartbeat | None = None  # multi-rank runs: names the silent rank when a collective fails
    attempt_store: AttemptStore | None = None  # torchrun --max-restarts: this attempt's rendezvous store

    def enter(self, where: str) -> None:
        """Record what this rank is doing (``step 3, update``): a failed collective's report names it."""
        if self.heartbeat is not None:
            self.heartbeat.enter(where)

    # --- groups ---------------------------------------------------------------------------
    @property
    def tp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group()

    @property
    def pp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_group()

    @property
    def cp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_context_parallel_group()

    @property
    def dp_group(self):
        """Data-parallel group (without CP)."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(with_context_parallel=False)

    @property
    def dp_cp_group(self):
        """Ranks that see different tokens of the same model replica: loss denominators reduce here."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(with_context_parallel=True)

    @property
    def ep_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_expert_model_parallel_group()

    @property
    def etp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_expert_tensor_parallel_group()

    # --- groups by meaning: who holds what of a step's rows and layers --------------------
    @property
    def row_parts_group(self):
        """The ranks that hold parts of the same rows (context parallel: other tokens of each row); None
        when each rank holds whole rows."""
        if self.layout.cp == 1:
            return None
        return self.cp_group

    @property
    def other_rows_group(self):
        """The ranks that hold other rows for the same weights (data parallel); None with one."""
        if self.layout.dp == 1:
            return None
        return self.dp_group

    def token_groups(self) -> list:
        """The groups whose ranks hold other tokens of the same layers: DP (other rows), CP (other parts
        of a row), TP under sequence parallelism (other sequence shards). A count of tokens is complete
        once summed over each of them."""
        groups = [self.dp_group]
        if self.layout.cp > 1:
            groups.append(self.cp_group)
        if self.layout.use_sequence_parallel:
            groups.append(self.tp_group)
        return groups

    def any_over_tokens_and_stages(self, flags: torch.Tensor) -> torch.Tensor:
        """Logical OR (as MAX, in place) over the ranks that hold other tokens of the same rows (CP,
        sequence-parallel TP) or other layers (PP); DP ranks hold other rows, which stay apart."""
        layout = self.layout
        holders = (
            (self.cp_group, layout.cp > 1),
            (self.tp_group, layout.use_sequence_parallel),
            (self.pp_group, layout.pp > 1),
        )
        for group in (group for group, holds in holders if holds):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return flags

    def sum_over_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum (in place) over the data-parallel ranks: a sum over this rank's rows becomes the step's."""
        if self.layout.dp > 1:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    # --- pipeline stages: what the last stage computed, on every stage --------------------
    def from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's ``tensor`` on every stage of this rank's pipeline (in place; same shape)."""
        if self.layout.pp > 1:
            dist.broadcast(tensor, src=self.last_stage_global_rank, group=self.pp_group)
        return tensor

    def object_from_last_stage(self, value: T) -> T:
        """The last stage's ``value`` (any picklable object) on every stage of this rank's pipeline."""
        if self.layout.pp == 1:
            return value
        payload = [value]
        dist.broadcast_object_list(payload, src=self.last_stage_global_rank, group=self.pp_group)
        return payload[0]

    # --- ranks ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp_group)

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp_group)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def last_stage_global_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        return dist.get_global_rank(self.pp_group, self.layout.pp - 1)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that talks to the rollout engine and writes run files."""
        return dist.get_rank() == 0

    def destroy(self) -> None:
        from megatron.core import parallel_state as ps

        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_single_process(backend: str, timeout_s: float) -> None:
    """One rank: an in-process store instead of a TCPStore (which listens on every interface), and
    gloo's own sockets on the loopback interface unless the user chose one: nothing to reach from outside."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo reads its interface only from here
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))


def initialize_parallel(layout: ParallelLayout, seed: int = 1234, timeout_s: float = 600.0) -> ParallelMesh:
    """Start torch.distributed (env:// rendezvous from torchrun) and megatron's parallel state.

    NCCL with CUDA, gloo without; on CPU the megatron-core compatibility bridges must have been applied
    (``policy/cpu_bridges.py:apply_cpu_bridges``, the start-up call): forming groups patches nothing.
    A single-process run (no ``WORLD_SIZE``, or 1) opens no port reachable from other machines.
    ``timeout_s`` bounds every collective, megatron's groups included (they default to 30 min).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    use_cuda = cuda_kernels()
    attempt: AttemptStore | None = None
    if not use_cuda and not cpu_megatron_enabled():
        raise RuntimeError(
            "megatron-core without CUDA needs the CPU bridges: call "
            "gspo_megatron.policy.cpu_bridges.apply_cpu_bridges() at start-up, before forming process groups"
        )
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            _init_single_process(backend, timeout_s)
        elif restarts_possible():  # torchrun --max-restarts: this attempt's own store (attempt_store.py)
            attempt = open_attempt_store(
                int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s
            )
            dist.init_process_group(
                backend,
                store=attempt.store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timedelta(seconds=timeout_s),
            )
        else:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(
            f"the layout was validated for world size {layout.world_size} but torch.distributed has "
            f"{world} ranks; launch with --nproc-per-node x --nnodes = {layout.world_size}"
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        distributed_timeout_minutes=timeout_s / 60,  # used as timedelta(minutes=...): a float is fine
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    heartbeat = None
    if world > 1 and attempt is not None:
        heartbeat = Heartbeat(dist.get_rank(), world, attempt.host, attempt.port)
    elif world > 1 and "MASTER_ADDR" in os.environ:  # env:// rendezvous: the store every rank met at
        heartbeat = Heartbeat(dist.get_rank(), world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return ParallelMesh(
        layout=layout, device=compute_device(), timeout_s=timeout_s, heartbeat=heartbeat, attempt_store=attempt
    )
