"""Routing bookkeeping of one RL step: old-policy routing, replay targets and volatility diagnostics.

What is measured (``routing.kinds``; the math is ``routing/volatility.py``):
- ``update``: the routing of the old-policy pass vs the routing of the same tokens right after the
  first optimizer step of the step -- the GSPO paper's "experts that change after one gradient
  update" (about 10% per update for Qwen3-30B-A3B). Without replay and with >= 2 updates this is
  free: the second mini-batch's training forward is recorded (it runs after exactly one step).
  Otherwise (replayed forwards do not route freely) a forward-only recording pass over the first
  mini-batch runs after the first step;
- ``minibatch``: the same recording pass after update m vs after update m-1 (drift across updates);
- ``rollout_vs_train``: the experts the rollout engine used vs the trainer's old-policy routing of
  the same tokens (MoE layers only; SGLang/embedded rows include dense layers).

With pi_old from the engine (``algorithm.old_log_probs=rollout``) no old-policy pass runs: the first
update's training forward (before any optimizer step) is recorded as the old policy's routing of
the first mini-batch, and every kind compares against that.

Under rollout replay (R3) the old-policy pass replays the engine's routing instead of recording
one, so there is no free routing for ``update``/``minibatch``; ``rollout_vs_train`` compares the
engine's experts with the ones the replaying forward actually routed with (observed in megatron's
top-k), so an R3 run measures -- rather than assumes -- that replay removed the routing mismatch.

``ratio_decomposition`` (``routing/ratio_decomposition.py``): at the last update of a due step, the
ratio the loss uses is split into its routing part and its weight part. Cost: two forward-only
passes over that update's mini-batch (the loss's routing -- a repeat of the training forward, whose
log-probs the loss head does not hand back -- and the old pass's routing replayed), i.e. about
2/3 of one more forward-backward of one mini-batch per diagnosed step, ~2/(3k) of the update phase
with k updates per rollout; logged as ``time/ratio_decomposition`` (measured: 0.97 s of a 20.7 s
update phase at k = 16 on small_moe, README "The mechanism"). Reading the training forward's own
log-probs would save one of the two passes; not done, to leave the loss path untouched. It needs
the trainer's old-log-prob pass (not ``algorithm.old_log_probs=rollout``).

Counts are merged exactly over micro-batches, data-parallel ranks and (under sequence parallelism)
tensor-parallel ranks; pipeline stages contribute their own layers, concatenated in stage order.
Only the driver writes ``routing.jsonl``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from gspo_megatron.models.micro_batch import MicroBatch, required
from gspo_megatron.parallel.context_parallel import split_sequence
from gspo_megatron.routing.ratio_decomposition import RatioDecomposition, changed_in_any_layer, decompose_log_ratio
from gspo_megatron.routing.volatility import (
    ExpertLoad,
    RoutingVolatility,
    all_reduce_expert_load,
    all_reduce_volatility,
    expert_load,
    routing_volatility,
)

Counts = TypeVar("Counts", RoutingVolatility, ExpertLoad)


class RoutingDiagnostics:
    def __init__(self, config, components, mesh, *, replays_in_training: bool):
        self.config = config
        self.replays_in_training = replays_in_training  # R2/R3: no free routing in a training forward
        self.c = components
        self.mesh = mesh
        self.old: list[list[torch.Tensor]] = []  # per old-pass micro-batch: per layer [tokens, k]
        self.old_masks: list[torch.Tensor] = []
        self.old_used: list[list[torch.Tensor]] = []  # the routing the old pass used (R3: the engine's)
        self.decomposition: RatioDecomposition | None = None
        self.decomposition_seconds = 0.0  # its cost, logged as time/ratio_decomposition
        self.previous: list | None = None
        self.step_records: list[tuple[str, RoutingVolatility, ExpertLoad | None]] = []

    # --- old-policy routing --------------------------------------------------------------------
    @property
    def _engine_old_policy(self) -> bool:
        """pi_old is the engine's (``algorithm.old_log_probs=rollout``): no old-policy pass runs."""
        return self.c.cfg.algorithm.old_log_probs == "rollout"

    def remember_old_routing(
        self, recorded: list | None, micro_batches: list[MicroBatch], used: list | None = None
    ) -> None:
        self.old = recorded or []
        self.old_used = used or []
        self.old_masks = [_token_mask(mb, self.mesh) for mb in micro_batches]
        self.step_records = []
        self.previous = None

    def old_routing_for(self, first: int, count: int) -> list[list[torch.Tensor]]:
        if first + count > len(self.old):
            raise RuntimeError(
                f"old-policy replay needs recorded routing for micro-batches {first}..{first + count - 1} "
                f"but only {len(self.old)} were recorded"
            )
        return self.old[first : first + count]

    # --- diagnostics ---------------------------------------------------------------------------
    def due(self, kind: str, step: int) -> bool:
        return self.c.replay is not None and self.config.is_due(step, kind)

    def rollout_vs_train(self, step: int, micro_batches: list[MicroBatch], targets_of, trainer_routing: list) -> None:
        """Engine routing (per micro-batch, megatron order) vs the routing of the old-log-prob pass."""
        if not self.due("rollout_vs_train", step) or not trainer_routing or micro_batches[0].routed_experts is None:
            return
        parts = []
        for mb, recorded, mask in zip(micro_batches, trainer_routing, self.old_masks):
            engine = torch.stack(targets_of(mb), dim=1)
            trainer = torch.stack(recorded, dim=1)
            parts.append(routing_volatility(engine, trainer, mask))
        self.step_records.append(("rollout_vs_train", RoutingVolatility.merge_all(parts), None))

    def records_training_forward(self, update: int, step: int) -> bool:
        """Whether update ``update``'s training forward is recorded: the free "update" measurement
        (update 1), or -- with pi_old from the engine, when no old-policy pass ran -- the old
        policy's routing of the first mini-batch (update 0, before any optimizer step)."""
        if self.replays_in_training:
            return False
        if self._engine_old_policy:
            kinds = ("update", "minibatch", "rollout_vs_train")
            return update == 0 and any(self.due(kind, step) for kind in kinds)
        return update == 1 and self.due("update", step)

    def from_training_forward(
        self, recorded: list, old_offset: int, micro_batches: list[MicroBatch], targets_of, step: int
    ) -> None:
        if self._engine_old_policy:
            self.old = recorded  # the old policy's routing of the first mini-batch
            self.rollout_vs_train(step, micro_batches, targets_of, recorded)
            return
        masks = self.old_masks[old_offset : old_offset + len(recorded)]
        base = self.old[old_offset : old_offset + len(recorded)]
        self.step_records.append(("update", _compare(base, recorded, masks), _load(recorded, masks, self.c)))

    def after_update(self, update: int, step: int, first_micro_batches: list[MicroBatch]) -> None:
        """Recording pass over the first mini-batch after optimizer step ``update``, when needed."""
        free = (
            not self.replays_in_training and self.c.cfg.trainer.updates_per_rollout > 1 and not self._engine_old_policy
        )
        want_update = update == 0 and self.due("update", step) and not free
        want_minibatch = self.due("minibatch", step) and self.c.cfg.trainer.updates_per_rollout > 1
        if not (want_update or want_minibatch) or not self.old:
            return
        from gspo_megatron.models.schedule import run_schedule

        replay = self.c.replay
        replay.start_recording()
        run_schedule(self.c.model, first_micro_batches, None, forward_only=True)
        now = replay.recorded()
        replay.stop()
        masks = self.old_masks[: len(first_micro_batches)]
        if want_update:
            base = self.old[: len(first_micro_batches)]
            self.step_records.append(("update", _compare(base, now, masks), _load(now, masks, self.c)))
        if want_minibatch and self.previous is not None:
            self.step_records.append(("minibatch", _compare(self.previous, now, masks), None))
        self.previous = now

    def decompose_ratio(
        self, update: int, step: int, micro_batches: list[MicroBatch], old_offset: int, strategy, algorithm
    ) -> None:
        """At the last update of a due step, before its training forward (same weights): the log-probs
        under the loss's routing and under the old pass's routing, split by ``decompose_log_ratio``."""
        last = update == self.c.cfg.trainer.updates_per_rollout - 1
        if not (last and self.due("ratio_decomposition", step)) or not self.old_used:
            return
        from gspo_megatron.models.schedule import run_schedule
        from gspo_megatron.trainer.loss_head import LogProbHead

        started = time.perf_counter()
        cfg, mesh, replay = self.c.cfg, self.mesh, self.c.replay
        head = LogProbHead(
            mesh.tp_group,
            cfg.rollout.temperature,
            cfg.algorithm.logprob_chunk_size,
            cp_group=mesh.cp_group if mesh.layout.cp > 1 else None,
        )
        old = self.old_used[old_offset : old_offset + len(micro_batches)]
        if self.replays_in_training:  # R2/R3: the loss replays the old pass's routing
            before = strategy.update_begin(micro_batches, lambda: old)
            train = run_schedule(self.c.model, micro_batches, head, forward_only=True, before_forward=before)
            strategy.update_end()
            changed = [torch.zeros(mb.num_rows * mb.seq_len, dtype=torch.bool) for mb in micro_batches]
        else:
            replay.start_recording()
            train = run_schedule(self.c.model, micro_batches, head, forward_only=True)
            now = replay.recorded()
            replay.stop()
            changed = [
                _rows_of_tokens(changed_in_any_layer(torch.stack(a, 1), torch.stack(b, 1)), mb, mesh)
                for a, b, mb in zip(old, now, micro_batches)
            ]
        replay.load_targets(old)
        replayed = run_schedule(
            self.c.model, micro_batches, head, forward_only=True, before_forward=replay.before_forward
        )
        replay.assert_fully_consumed()
        replay.stop()
        changed = self._any_rank(changed)
        total = RatioDecomposition.zeros()
        for mb, flags, train_out, old_out in zip(micro_batches, changed, train, replayed):
            total = total.merge(
                decompose_log_ratio(
                    train_out["log_probs"].cpu(),
                    old_out["log_probs"].cpu(),
                    required(mb.old_log_probs, "old_log_probs", "ratio decomposition").cpu(),
                    required(mb.response_mask, "response_mask", "ratio decomposition").cpu(),
                    flags.reshape(mb.num_rows, mb.seq_len),
                    required(mb.advantages, "advantages", "ratio decomposition").cpu(),
                    algorithm.clip_low,
                    algorithm.clip_high,
                )
            )
        # rows differ over data-parallel ranks; only the last pipeline stage has log-probs (others: 0)
        for group, size in ((mesh.dp_group, mesh.layout.dp), (mesh.pp_group, mesh.layout.pp)):
            if size > 1:
                total = RatioDecomposition(total.all_reduce_on(mesh.device, group))
        self.decomposition = total if self.decomposition is None else self.decomposition.merge(total)
        self.decomposition_seconds += time.perf_counter() - started

    def _any_rank(self, flags: list[torch.Tensor]) -> list[torch.Tensor]:
        """OR over the ranks that hold other tokens (CP, sequence-parallel TP) or other layers (PP)."""
        layout = self.mesh.layout
        groups = [
            group
            for group, size in (
                (self.mesh.cp_group, layout.cp),
                (self.mesh.tp_group, layout.tp if layout.use_sequence_parallel else 1),
                (self.mesh.pp_group, layout.pp),
            )
            if size > 1
        ]
        if not groups:
            return flags
        flat = torch.cat(flags).to(self.mesh.device, torch.int32)
        for group in groups:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        return list(flat.bool().cpu().split([f.numel() for f in flags]))

    def finish_step(self, step: int) -> dict[str, float]:
        """Reduce this step's records over ranks, write routing.jsonl (driver), return scalars."""
        metrics: dict[str, float] = {}
        if self.decomposition is not None:
            metrics.update(self.decomposition.metrics())
            metrics["time/ratio_decomposition"] = self.decomposition_seconds
            self.decomposition, self.decomposition_seconds = None, 0.0
        for kind, volatility, load in self.step_records:
            volatility = self._reduce(volatility, all_reduce_volatility)
            load = self._reduce(load, all_reduce_expert_load) if load is not None else None
            metrics[f"routing/{kind}_changed_frac"] = float(volatility.changed_frac_overall)
            metrics[f"routing/{kind}_overlap"] = float(volatility.overlap_overall)
            metrics[f"routing/{kind}_changed_any_frac"] = float(volatility.changed_any_frac)
            if self.mesh.is_driver and self.c.routing_log is not None:
                self.c.routing_log.log(step, kind, volatility=volatility, load=load)
        self.step_records = []
        return metrics

    def _groups(self):
        groups = [self.mesh.dp_group]
        if self.mesh.layout.cp > 1:  # CP ranks hold different tokens of the same rows
            groups.append(self.mesh.cp_group)
        if self.mesh.layout.use_sequence_parallel:
            groups.append(self.mesh.tp_group)
        return groups

    def _reduce(self, counts: Counts, all_reduce: Callable[[Counts, object], Counts]) -> Counts:
        """Sum over the ranks that hold other tokens of the same layers; concatenate the pipeline
        stages' layers (in stage order)."""
        counts = counts.to(self.mesh.device)  # NCCL reduces device tensors only
        for group in self._groups():
            counts = all_reduce(counts, group)
        counts = counts.to("cpu")
        if self.mesh.layout.pp > 1:
            gathered: list[Counts | None] = [None] * self.mesh.layout.pp
            dist.all_gather_object(gathered, counts, group=self.mesh.pp_group)
            counts = type(counts).concat_layers([p for p in gathered if p is not None])
        return counts


def _compare(before: list, after: list, masks: list) -> RoutingVolatility:
    parts = [
        routing_volatility(torch.stack(a, dim=1), torch.stack(b, dim=1), m) for a, b, m in zip(before, after, masks)
    ]
    return RoutingVolatility.merge_all(parts)


def _load(routing: list, masks: list, components):
    parts = [expert_load(torch.stack(r, dim=1), components.cfg.model.num_experts, m) for r, m in zip(routing, masks)]
    total = parts[0]
    for part in parts[1:]:
        total = total.merge(part)
    return total


def _rows_of_tokens(local: torch.Tensor, micro_batch: MicroBatch, mesh) -> torch.Tensor:
    """Per-token flags of this rank's tokens (megatron order, like ``_token_mask``) -> bool [b * s]
    over whole rows (row-major), False where another rank holds the token."""
    b, s = micro_batch.num_rows, micro_batch.seq_len
    index = torch.arange(b * s).reshape(b, s)
    index = split_sequence(index, mesh.layout.cp, mesh.cp_rank if mesh.layout.cp > 1 else 0).transpose(0, 1)
    if mesh.layout.use_sequence_parallel and mesh.layout.tp > 1:
        index = index.chunk(mesh.layout.tp, dim=0)[mesh.tp_rank]
    rows = torch.zeros(b * s, dtype=torch.bool)
    rows[index.reshape(-1)] = local.cpu()
    return rows


def _token_mask(micro_batch: MicroBatch, mesh) -> torch.Tensor:
    """bool [s_local * b] in megatron's token order: real (non-padding) input tokens."""
    mask = split_sequence(
        required(micro_batch.input_mask, "input_mask", "routing diagnostics"),
        mesh.layout.cp,
        mesh.cp_rank if mesh.layout.cp > 1 else 0,
    )
    mask = mask.bool().transpose(0, 1)  # [s, b]
    if mesh.layout.use_sequence_parallel and mesh.layout.tp > 1:
        mask = mask.chunk(mesh.layout.tp, dim=0)[mesh.tp_rank]
    return mask.reshape(-1)
