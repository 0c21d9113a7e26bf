"""Weight sync from the trainer's ranks into the rollout engine, bounded in memory and re-readable.

Design decisions:
- The weights travel as a stream of (HF name, full tensor): the policy's export (``Policy.export``,
  ``policy/models/conversion.py:export_hf_tensors``) gathers one parameter at a time and the engine decides
  the bucket (SGLang: one ``/update_weights_from_distributed`` per ``weight_bucket_bytes``; the embedded
  engine loads each tensor as it comes). No rank holds more than the engine's bucket plus one parameter's
  gather beyond its shard; the driver never holds the model (it did: the engine listed the whole export).
- The engine may read the weights more than once (SGLang retries a failed distributed update
  through the disk path), and only the driver knows whether it will. Every pass is a fresh collective
  export, so the other ranks must join it: before each pass the driver broadcasts MORE (1) to every
  rank, after the engine returned DONE (0). ``DriverWeightSync`` is the driver's half (the rollout side's
  engine reads), ``FollowerWeightSync`` the other ranks' (``follow_weight_stream``).
- A pass the engine abandoned half-way (a bucket refused by a server) is drained before anything
  else happens on the driver: the other ranks are inside that pass's collectives and would deadlock
  against a new pass or the DONE broadcast.
- Per-stage senders (SGLang's distributed sync with pipeline stages, ``weight_senders=per_stage``): the
  driver's stream is ``StagedDriverStream``; the engine calls its ``send_by_stages``, which announces
  STAGES (2) and runs ``rollout/sglang/stage_turns.py:StageTurns`` on every rank; the disk fallback still iterates it
  (a full export pass, MORE).
- After DONE the driver broadcasts the outcome, so a failed sync raises on every rank (not only on the
  driver, while the others wait in the next step's collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from gspo_megatron.core.named_tensors import NamedTensor

if TYPE_CHECKING:
    from gspo_megatron.rollout.sglang.group_sender import SenderBrief
    from gspo_megatron.rollout.sglang.stage_turns import StageTurns

MORE, DONE, STAGES = 1, 0, 2


class WeightSyncFailed(RuntimeError):
    """The driver's weight sync failed; raised on every rank."""


class DriverWeightStream:
    """The driver's re-iterable view of the export: each ``iter()`` announces and starts one pass."""

    def __init__(self, export_pass: Callable[[], Iterator[NamedTensor]], announce: Callable[[int], None]):
        self._export_pass = export_pass
        self._announce = announce
        self._active: Iterator[NamedTensor] | None = None
        self.passes = 0

    def __iter__(self) -> Iterator[NamedTensor]:
        self._drain()
        self._announce(MORE)
        self.passes += 1
        self._active = self._export_pass()
        return self._active

    def close(self) -> None:
        """Finish an abandoned pass, then release the other ranks (DONE)."""
        self._drain()
        self._announce(DONE)

    def _drain(self) -> None:
        if self._active is not None:
            for _ in self._active:  # the other ranks are still in this pass's collectives
                pass
            self._active = None


class StagedDriverStream(DriverWeightStream):
    """The driver's stream when every pipeline stage sends its own layers (``StagedWeights``)."""

    def __init__(
        self,
        export_pass: Callable[[], Iterator[NamedTensor]],
        announce: Callable[[int], None],
        turns: StageTurns,
    ):
        super().__init__(export_pass, announce)
        self._turns = turns

    def send_by_stages(self, brief: SenderBrief, send_own: Callable[[Iterable[NamedTensor]], None]) -> None:
        self._drain()
        self._announce(STAGES)
        self.passes += 1
        self._turns.run(brief, send_own)


def follow_weight_stream(
    export_pass: Callable[[], Iterator[NamedTensor]], receive: Callable[[], int], turns: StageTurns | None = None
) -> int:
    """A non-driver rank's half: join one export pass per MORE, the stages' turns per STAGES, until
    DONE; returns the passes made."""
    passes = 0
    while (command := receive()) != DONE:
        if command == STAGES:
            assert turns is not None, "the driver announced per-stage senders this rank was not built with"
            turns.run(None, None)
        else:
            for _ in export_pass():
                pass
        passes += 1
    return passes


class WeightSync(Protocol):
    def sync(self, version: int) -> int:
        """Collective on every rank: the policy's weights into the engine at ``version``; the passes made."""

    def close(self) -> None:
        """This rank's stage sender leaves its update group (per-stage senders)."""


class DriverWeightSync:
    """The driver's weight sync: the policy's export streamed into the rollout side's engine."""

    def __init__(
        self,
        export_pass: Callable[[], Iterator[NamedTensor]],
        load_weights: Callable[[Iterable[NamedTensor], int], None],
        device: torch.device,
        turns: StageTurns | None = None,
    ) -> None:
        """``export_pass``: one pass of the policy's HF-named tensors (``Policy.export``);
        ``load_weights``: the engine's (``RolloutSide.load_weights``); ``turns``: this rank's part when
        every pipeline stage sends its own layers."""
        self.export_pass, self.load_weights, self.device, self.turns = export_pass, load_weights, device, turns

    def sync(self, version: int) -> int:
        """Collective on every rank; returns the export passes made (2 when the engine read twice)."""
        world = _world()
        signal = torch.zeros(1, dtype=torch.int64, device=self.device)

        def announce(value: int) -> None:
            if world > 1:
                signal.fill_(value)
                dist.broadcast(signal, src=0)

        stream = (
            StagedDriverStream(self.export_pass, announce, self.turns)
            if self.turns is not None
            else DriverWeightStream(self.export_pass, announce)
        )
        failure: BaseException | None = None
        try:
            self.load_weights(stream, version)
        except BaseException as error:  # noqa: BLE001 - re-raised once every rank knows
            failure = error
        finally:
            stream.close()
        _share_outcome(failure, world)
        if failure is not None:
            raise failure
        return stream.passes

    def close(self) -> None:
        if self.turns is not None:
            self.turns.close()


class FollowerWeightSync:
    """Every other rank's weight sync: it joins each export pass the driver's engine reads."""

    def __init__(
        self, export_pass: Callable[[], Iterator[NamedTensor]], device: torch.device, turns: StageTurns | None = None
    ) -> None:
        self.export_pass, self.device, self.turns = export_pass, device, turns

    def sync(self, version: int) -> int:
        """Collective on every rank; returns the export passes made."""
        signal = torch.zeros(1, dtype=torch.int64, device=self.device)

        def receive() -> int:
            dist.broadcast(signal, src=0)
            return int(signal.item())

        passes = follow_weight_stream(self.export_pass, receive, self.turns)
        _share_outcome(None, _world())
        return passes

    def close(self) -> None:
        if self.turns is not None:
            self.turns.close()


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _share_outcome(failure: BaseException | None, world: int) -> None:
    """The driver's outcome on every rank: the others raise ``WeightSyncFailed`` when it failed."""
    if world == 1:
        return
    outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(outcome, src=0)
    if failure is None and outcome[0] is not None:
        raise WeightSyncFailed(f"the driver's weight sync failed: {outcome[0]}")
