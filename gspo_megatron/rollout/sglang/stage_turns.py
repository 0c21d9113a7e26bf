"""A distributed weight sync where every pipeline stage sends its own layers (``weight_senders=per_stage``).

Every rank runs ``StageTurns.run`` when the driver announces STAGES (``weight_stream.py``). The driver
(stage 0's sender) owns the servers' weight-update session; stage k's sender is the rank of stage k in
the driver's pipeline, and broadcasts its stage's HF tensors over its own update group
(``<group>_stage<k>``) with its own HTTP client, as slime's per-stage senders do.

Design decisions:
- Turns, in stage order: SGLang receives a distributed update inside its scheduler loop, one
  ``/update_weights_from_distributed`` at a time per server, and every server takes part in every group's
  broadcast -- two stages sending at once into two servers could each hold one server and wait for the
  other (a deadlock). In stage k's turn the stage's ranks export its units (gathered over TP/EP inside
  the stage, never broadcast to another stage) and the sender sends them; the other stages wait. So no
  rank holds a tensor of another stage, and the pipeline hop of the driver-only path disappears.
- All or nothing: the buckets carry no weight version; after each turn the sender broadcasts its outcome
  to every rank, a failed turn ends the sync (later stages do not send), and the driver sets the version
  on the servers (``/update_weight_version``) only when every stage has sent. A failed sender drops its
  own group (re-formed on the next sync); the driver's engine then falls back to the disk path or raises.
- A stage's sender learns the live servers from the driver each sync (``SenderBrief``); a changed set
  re-forms its group. Its master address: the configured one on a single host (loopback), else its own
  host's address (``group_sender.sender_address``); its port: the configured one plus k, or a free one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch.distributed as dist

from gspo_megatron.core.named_tensors import NamedTensor
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.group_sender import (
    GroupSender,
    SenderBrief,
    StageSyncError,
    sender_address,
    stage_group_name,
    stage_master_port,
)
from gspo_megatron.rollout.sglang.server_calls import LoopThread, ServerCalls, make_client

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagePosition:
    """This rank's place in the pipeline, as the turns need it."""

    rank: int  # global rank
    pp_rank: int  # this rank's pipeline stage
    is_driver: bool  # global rank 0: stage 0's sender, which owns the servers' weight-update session
    stage_senders: list[int]  # the global rank of each stage in this rank's pipeline (the driver's is used)


class StageTurns:
    """This rank's part in per-stage syncs; holds its stage's sender (and HTTP client) across syncs."""

    def __init__(
        self, own_stage_tensors: Callable[[], Iterator[NamedTensor]], position: StagePosition, config: SGLangConfig
    ):
        """``own_stage_tensors``: one pass of this stage's HF tensors, gathered inside the stage (collective
        over the stage's ranks)."""
        self.own_stage_tensors, self.position, self.config = own_stage_tensors, position, config
        self._sender: GroupSender | None = None  # stages k > 0: this rank's, once it has sent
        self._loop: LoopThread | None = None
        self.sent_names: list[str] = []  # what this rank sent in the last sync (tests read it)

    def run(self, brief: SenderBrief | None, send_own: Callable[[Iterable[NamedTensor]], None] | None) -> None:
        """One sync's turns; collective on every rank (the driver passes the brief and its own sender).
        Raises ``StageSyncError`` on the driver when a stage failed; the other ranks return."""
        position = self.position
        payload: list = [(brief, position.stage_senders) if position.is_driver else None]
        dist.broadcast_object_list(payload, src=0)
        brief, senders = payload[0]
        self.sent_names = []
        for stage, sender in enumerate(senders):
            error = None
            if position.pp_rank == stage:
                named = self.own_stage_tensors()
                if position.rank == sender:
                    error = self._send(stage, brief, named, send_own)
                for _ in named:  # the stage's other ranks join its gathers; a failed sender finishes them
                    pass
            status = [error]
            dist.broadcast_object_list(status, src=sender)
            if status[0] is not None:
                if position.is_driver:
                    raise StageSyncError(
                        f"pipeline stage {stage} (rank {sender}) failed to send its weights: {status[0]}; "
                        f"no server was moved to the new version"
                    )
                return

    def _send(
        self,
        stage: int,
        brief: SenderBrief,
        named: Iterator[NamedTensor],
        send_own: Callable[[Iterable[NamedTensor]], None] | None,
    ) -> str | None:
        try:
            if stage == 0:
                assert send_own is not None, "stage 0's sender is the driver, which passes its own"
                send_own(named)
                return None
            sender = self._sender_for(stage, brief)
            sender.send(sender.calls.client.pool.servers, brief.tp_sizes, brief.quantized(named), None)
            self.sent_names = sender.sent_names
            return None
        except Exception as error:  # noqa: BLE001 - every rank learns it from the status broadcast
            if stage > 0 and self._sender is not None:
                self._sender.drop()  # its group is in an unknown state: re-formed next time
            logger.warning("stage %d's weight sender failed: %s", stage, error)
            return f"{type(error).__name__}: {error}"

    def _sender_for(self, stage: int, brief: SenderBrief) -> GroupSender:
        if self._sender is not None and tuple(s.url for s in self._sender.calls.client.pool.servers) != brief.urls:
            self.close()  # the live servers changed: a new client and group
        if self._sender is None:
            config = self.config
            self._loop = LoopThread()
            client = self._loop.run(make_client(list(brief.urls), config, brief.api_key))
            self._sender = GroupSender(
                ServerCalls(client, self._loop),
                config,
                stage_group_name(config.weight_sync_group_name, stage),
                sender_address(config),
                stage_master_port(config, stage),
            )
        return self._sender

    def close(self) -> None:
        """Drop this rank's group on the servers and close its client (attached servers outlive the run)."""
        sender, loop = self._sender, self._loop
        self._sender, self._loop = None, None
        if sender is not None and loop is not None:
            try:
                sender.drop()
            finally:
                loop.run(sender.calls.client.aclose())
                loop.close()
