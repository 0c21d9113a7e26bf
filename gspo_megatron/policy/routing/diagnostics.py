"""Routing bookkeeping of one RL step: old-policy routing, replay targets and volatility diagnostics.

What is measured (``routing.kinds``; the math is ``policy/routing/volatility.py``):
- ``update``: the routing of the old-policy pass vs the routing of the same tokens right after the
  first optimizer step of the step -- the GSPO paper's "experts that change after one gradient
  update" (about 10% per update for Qwen3-30B-A3B). Without replay and with >= 2 updates this is
  free: the second mini-batch's training forward is recorded (it runs after exactly one step).
  Otherwise (replayed forwards do not route freely) a forward-only recording pass over the first
  mini-batch runs after the first step;
- ``minibatch``: the same recording pass after update m vs after update m-1 (drift across updates);
- ``rollout_vs_train``: the experts the rollout engine used vs the trainer's old-policy routing of
  the same tokens (MoE layers only; SGLang/embedded rows include dense layers).

With pi_old from the engine (``trainer.old_log_probs=rollout``) no old-policy pass runs: the first
update's training forward (before any optimizer step) is recorded as the old policy's routing of
the first mini-batch, and every kind compares against that.

Under rollout replay (R3) the old-policy pass replays the engine's routing instead of recording
one, so there is no free routing for ``update``/``minibatch``; ``rollout_vs_train`` compares the
engine's experts with the ones the replaying forward actually routed with (observed in megatron's
top-k), so an R3 run measures -- rather than assumes -- that replay removed the routing mismatch.

With ``update`` due, the old-policy pass's recording also gives each token's top-k margin (the k-th minus
the (k+1)-th router score, ``policy/routing/topk_margin.py``): how close the routing the update then changes
was to changing, logged as ``routing/topk_margin_*`` and per layer in the ``update`` record of routing.jsonl.

``ratio_decomposition`` (``policy/routing/ratio_decomposition.py``): at the last update of a due step, the
ratio the loss uses is split into its routing part and its weight part. Cost: two forward-only
passes over that update's mini-batch (the loss's routing -- a repeat of the training forward, whose
log-probs the loss head does not hand back -- and the old pass's routing replayed), i.e. about
2/3 of one more forward-backward of one mini-batch per diagnosed step, ~2/(3k) of the update phase
with k updates per rollout; logged as ``time/ratio_decomposition`` (measured: 0.97 s of a 20.7 s
update phase at k = 16 on small_moe, docs/studies.md "The mechanism"). Reading the training forward's own
log-probs would save one of the two passes; not done, to leave the loss path untouched. It needs
the trainer's old-log-prob pass (not ``trainer.old_log_probs=rollout``).

This module only consumes recordings: which forward is recorded is the routing plan's decision
(``policy/routing/plan.py``), the forwards (and the extra passes) run under ``policy/routing/step_routing.py``'s
contexts and every recording starts and stops in ``policy/routing/recorder.py``.

Multi-turn trajectories (``rollout.agent``, ``RoutingPlan.turns`` > 0): every volatility kind is also measured
per turn -- over the positions turn t's engine call fed (``MicroBatch.input_turns``: its prefill of the prompt
or of the inserted tokens and the last token of the turn before, then its decode steps) -- as
``routing/<kind>_changed_frac/turn_<t>`` and routing.jsonl records with ``"turn": t``; the ratio decomposition
too, over the tokens turn t generated (``ratio_decomp/turn_<t>/token_*``). Where in a trajectory routing
moves, and whether replay holds on every turn. Turn indices past ``turns - 1`` (an agent's own limit is
``rollout.agent.max_turns``) count in the last.

Counts are merged exactly over micro-batches, data-parallel ranks and (under sequence parallelism)
tensor-parallel ranks; pipeline stages contribute their own layers, concatenated in stage order.
Only the driver writes ``routing.jsonl``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from gspo_megatron.contracts.micro_batch import MicroBatch, StepMicroBatch, UpdateMicroBatch
from gspo_megatron.contracts.phases import RoutingResult
from gspo_megatron.policy.parallel.context_parallel import split_sequence
from gspo_megatron.policy.parallel.mesh import ParallelMesh
from gspo_megatron.policy.routing.config import DiagnosticKind
from gspo_megatron.policy.routing.log import routing_record
from gspo_megatron.policy.routing.plan import RecordingPass, RoutingPlan
from gspo_megatron.policy.routing.ratio_decomposition import (
    RatioDecomposition,
    changed_in_any_layer,
    decompose_log_ratio,
)
from gspo_megatron.policy.routing.recorder import Routing
from gspo_megatron.policy.routing.replay_strategy import TargetsOf
from gspo_megatron.policy.routing.topk_margin import TopkMargins, all_reduce_margins, topk_margins
from gspo_megatron.policy.routing.volatility import (
    ExpertLoad,
    RoutingVolatility,
    all_reduce_expert_load,
    all_reduce_volatility,
    expert_load,
    routing_volatility,
)

Counts = TypeVar("Counts", RoutingVolatility, ExpertLoad, TopkMargins)
Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # per micro-batch: two top-k routings [tokens, layers, k]
# the ratio decomposition's numbers logged per turn (token level: the tokens a turn generated)
TURN_DECOMPOSITION_KEYS = (
    "token_var_log_ratio",
    "token_var_share_routing",
    "token_var_share_weight",
    "token_var_share_cross",
    "token_changed_frac",
    "token_changed_clip_frac",
)


class LogProbs(Protocol):
    """A log-prob head's output per micro-batch (``policy/loss_heads.py``'s ``LogProbOutput``)."""

    @property
    def log_probs(self) -> torch.Tensor: ...  # float [b, s]


class RoutingDiagnostics:
    def __init__(self, plan: RoutingPlan, mesh: ParallelMesh, num_experts: int):
        self.plan = plan
        self.mesh = mesh
        self.num_experts = num_experts
        self.old: Routing = []  # per old-pass micro-batch: per layer [tokens, k]
        self.old_masks: list[torch.Tensor] = []
        self.engine_masks: list[torch.Tensor] = []  # old_masks but the positions no engine call fed
        self.old_turns: list[torch.Tensor] = []  # per micro-batch, like old_masks: each token's turn (multi-turn)
        self.old_used: Routing = []  # the routing the old pass used (R3: the engine's)
        self.decomposition: RatioDecomposition | None = None
        self.turn_decompositions: list[RatioDecomposition] = []
        self.decomposition_seconds = 0.0  # its cost, logged as time/ratio_decomposition
        self.previous: Routing | None = None
        self.margins: TopkMargins | None = None  # the old pass's top-k margins (with ``update`` due)
        # (kind, volatility, load, turn): turn None for every position, t for the positions turn t fed
        self.step_records: list[tuple[str, RoutingVolatility, ExpertLoad | None, int | None]] = []

    # --- old-policy routing --------------------------------------------------------------------
    def begin_step(self, micro_batches: Sequence[StepMicroBatch]) -> None:
        """A new step over ``micro_batches`` (all of the step's, in update order); no old routing yet."""
        self.old, self.old_used = [], []
        self.old_masks = [_token_mask(mb, self.mesh) for mb in micro_batches]
        # the positions an engine call fed (what rollout_vs_train can compare): all real ones but the prompt of
        # a trajectory that ended before its first turn (input_turns -1 on a real position)
        self.engine_masks = [
            mask if mb.input_turns is None else mask & (_token_turns(mb, self.mesh, None) >= 0)
            for mask, mb in zip(self.old_masks, micro_batches, strict=True)
        ]
        self.old_turns = (
            [_token_turns(mb, self.mesh, self.plan.turns) for mb in micro_batches] if self.plan.turns else []
        )
        self.step_records = []
        self.previous = None
        self.margins = None

    def from_old_pass(
        self,
        step: int,
        micro_batches: Sequence[MicroBatch],
        targets_of: TargetsOf,
        old_routing: Routing | None,
        used: Routing,
        margins: list[list[torch.Tensor]] | None = None,
    ) -> None:
        """The old-policy pass's routing: ``old_routing`` what R2 replays and "update" compares
        against (None under R3), ``used`` what it routed with (R3: the engine's, observed); ``margins``
        its recorded top-k margins per micro-batch and layer (none when it replayed)."""
        self.old = old_routing or []
        self.old_used = used
        self.rollout_vs_train(step, micro_batches, targets_of, used)
        if margins and self.plan.due(DiagnosticKind.update, step):
            parts = [topk_margins(m, mask) for m, mask in zip(margins, self.old_masks, strict=True)]
            self.margins = parts[0]
            for part in parts[1:]:
                self.margins = self.margins.merge(part)

    @property
    def has_old_routing(self) -> bool:
        return bool(self.old)

    def old_used_of(self, first: int, count: int) -> Routing:
        """The routing the old pass used for micro-batches ``first .. first + count - 1`` (empty: none ran)."""
        return self.old_used[first : first + count]

    # --- diagnostics ---------------------------------------------------------------------------
    def rollout_vs_train(
        self, step: int, micro_batches: Sequence[MicroBatch], targets_of: TargetsOf, trainer_routing: Routing
    ) -> None:
        """Engine routing (per micro-batch, megatron order) vs the routing of the old-log-prob pass."""
        due = self.plan.due(DiagnosticKind.rollout_vs_train, step)
        if not due or not trainer_routing or micro_batches[0].routed_experts is None:
            return
        # strict=False: the micro-batches cover the whole step, ``trainer_routing`` may cover only the first
        # mini-batch (the engine's pi_old: the first update's forward is the one recorded)
        pairs = [
            (torch.stack(targets_of(mb), dim=1), torch.stack(recorded, dim=1))
            for mb, recorded in zip(micro_batches, trainer_routing, strict=False)
        ]
        self._add("rollout_vs_train", pairs, 0, None, self.engine_masks)

    def from_training_forward(
        self, recorded: Routing, old_offset: int, micro_batches: Sequence[MicroBatch], targets_of: TargetsOf, step: int
    ) -> None:
        """A training forward the plan chose to record (``RoutingPlan.records_training_forward``)."""
        if self.plan.engine_old_policy:
            self.old = recorded  # the old policy's routing of the first mini-batch
            self.rollout_vs_train(step, micro_batches, targets_of, recorded)
            return
        masks = self.old_masks[old_offset : old_offset + len(recorded)]
        base = self.old[old_offset : old_offset + len(recorded)]
        self._add("update", _pairs(base, recorded), old_offset, self._load(recorded, masks))

    def from_recording_pass(self, purpose: RecordingPass, now: Routing) -> None:
        """The first mini-batch's routing, recorded after an optimizer step (``RoutingPlan.recording_pass_after``)."""
        masks = self.old_masks[: len(now)]
        if purpose.compares_to_old_policy:
            self._add("update", _pairs(self.old[: len(now)], now), 0, self._load(now, masks))
        if purpose.compares_to_previous and self.previous is not None:
            self._add("minibatch", _pairs(self.previous, now), 0, None)
        self.previous = now

    def add_ratio_decomposition(
        self,
        micro_batches: Sequence[UpdateMicroBatch],
        loss_outputs: Sequence[LogProbs],
        old_routing_outputs: Sequence[LogProbs],
        loss_routing: Routing,
        old_routing: Routing,
        clip: tuple[float, float],
    ) -> None:
        """The log-probs under the loss's routing and under the old pass's routing (same weights),
        split by ``decompose_log_ratio`` (``clip``: the configured eps_low, eps_high). ``loss_routing`` is
        what the loss's forward recorded (empty when it replayed the old pass's routing: then no token's
        experts changed)."""
        mesh = self.mesh
        if loss_routing:
            changed = [
                _rows_of_tokens(changed_in_any_layer(torch.stack(a, 1), torch.stack(b, 1)), mb, mesh)
                for a, b, mb in zip(old_routing, loss_routing, micro_batches, strict=True)
            ]
        else:
            changed = [torch.zeros(mb.num_rows * mb.seq_len, dtype=torch.bool) for mb in micro_batches]
        changed = self._any_rank(changed)
        totals = [RatioDecomposition.zeros() for _ in range(1 + self.plan.turns)]  # every token, then per turn
        # strict=False: only the last pipeline stage has log-probs (the outputs are empty on the others)
        for mb, flags, train_out, old_out in zip(
            micro_batches, changed, loss_outputs, old_routing_outputs, strict=False
        ):
            response = mb.response_mask.cpu()
            masks = [response] + [response * of_turn for of_turn in self._turn_rows(mb)]
            for index, mask in enumerate(masks):
                totals[index] = totals[index].merge(
                    decompose_log_ratio(
                        train_out.log_probs.cpu(),
                        old_out.log_probs.cpu(),
                        mb.old_log_probs.cpu(),
                        mask,
                        flags.reshape(mb.num_rows, mb.seq_len),
                        mb.advantages.cpu(),
                        *clip,
                    )
                )
        # rows differ over data-parallel ranks; only the last pipeline stage has log-probs (others: 0)
        for group, size in ((mesh.dp_group, mesh.layout.dp), (mesh.pp_group, mesh.layout.pp)):
            if size > 1:
                totals = [RatioDecomposition(total.all_reduce_on(mesh.device, group)) for total in totals]
        total, per_turn = totals[0], totals[1:]
        self.decomposition = total if self.decomposition is None else self.decomposition.merge(total)
        if self.turn_decompositions:
            per_turn = [a.merge(b) for a, b in zip(self.turn_decompositions, per_turn, strict=True)]
        self.turn_decompositions = per_turn

    def _turn_rows(self, micro_batch: MicroBatch) -> list[torch.Tensor]:
        """Per turn, bool [b, s]: the targets whose log-prob turn t's forward computed (the tokens it generated;
        ``_token_turns``' rule, whole rows); none without per-turn diagnostics."""
        if not self.plan.turns:
            return []
        turns = micro_batch.input_turns
        if turns is None:  # single-turn samples in a multi-turn run: one turn
            turns = torch.zeros(micro_batch.num_rows, micro_batch.seq_len, dtype=torch.long)
        turns = turns.cpu().clamp(max=self.plan.turns - 1)
        return [turns == t for t in range(self.plan.turns)]

    def _add(
        self, kind: str, pairs: Pairs, offset: int, load: ExpertLoad | None, masks_of: list[torch.Tensor] | None = None
    ) -> None:
        """The volatility of ``pairs`` (the step's micro-batches ``offset ..``) over every position (of
        ``masks_of``, by default the real ones), then per turn over the positions each turn fed."""
        masks = (self.old_masks if masks_of is None else masks_of)[offset : offset + len(pairs)]
        self.step_records.append((kind, _volatility(pairs, masks), load, None))
        turns = self.old_turns[offset : offset + len(pairs)]
        for t in range(self.plan.turns):
            turn_masks = [mask & (turn == t) for mask, turn in zip(masks, turns, strict=True)]
            self.step_records.append((kind, _volatility(pairs, turn_masks), None, t))

    def add_decomposition_seconds(self, seconds: float) -> None:
        self.decomposition_seconds += seconds

    def _load(self, routing: Routing, masks: list[torch.Tensor]) -> ExpertLoad:
        parts = [expert_load(torch.stack(r, dim=1), self.num_experts, m) for r, m in zip(routing, masks, strict=True)]
        total = parts[0]
        for part in parts[1:]:
            total = total.merge(part)
        return total

    def _any_rank(self, flags: list[torch.Tensor]) -> list[torch.Tensor]:
        """OR over the ranks that hold other tokens (CP, sequence-parallel TP) or other layers (PP)."""
        flat = self.mesh.any_over_tokens_and_stages(torch.cat(flags).to(self.mesh.device, torch.int32))
        return list(flat.bool().cpu().split([f.numel() for f in flags]))

    def finish_step(self, step: int) -> RoutingResult:
        """This step's diagnostics reduced over ranks: the scalars and the routing.jsonl records of ``step``."""
        metrics: dict[str, float] = {}
        records = []
        if self.decomposition is not None:
            metrics.update(self.decomposition.metrics())
            metrics["time/ratio_decomposition"] = self.decomposition_seconds
            for t, of_turn in enumerate(self.turn_decompositions):
                prefix = f"ratio_decomp/turn_{t}/"
                turn_metrics = of_turn.metrics(prefix)
                metrics.update({prefix + key: turn_metrics[prefix + key] for key in TURN_DECOMPOSITION_KEYS})
            self.decomposition, self.decomposition_seconds, self.turn_decompositions = None, 0.0, []
        margins = self._reduce(self.margins, all_reduce_margins) if self.margins is not None else None
        if margins is not None:
            metrics.update(margins.metrics())
        for kind, volatility, load, turn in self.step_records:
            volatility = self._reduce(volatility, all_reduce_volatility)
            load = self._reduce(load, all_reduce_expert_load) if load is not None else None
            of_update = margins if kind == "update" and turn is None else None
            suffix = "" if turn is None else f"/turn_{turn}"
            metrics[f"routing/{kind}_changed_frac{suffix}"] = float(volatility.changed_frac_overall)
            metrics[f"routing/{kind}_overlap{suffix}"] = float(volatility.overlap_overall)
            metrics[f"routing/{kind}_experts_changed_per_slot{suffix}"] = float(volatility.experts_changed_per_slot)
            metrics[f"routing/{kind}_changed_any_frac{suffix}"] = float(volatility.changed_any_frac)
            records.append(routing_record(step, kind, volatility=volatility, load=load, turn=turn, margins=of_update))
        self.step_records, self.margins = [], None
        return RoutingResult(metrics, records)

    def _reduce(self, counts: Counts, all_reduce: Callable[[Counts, object], Counts]) -> Counts:
        """Sum over the ranks that hold other tokens of the same layers; concatenate the pipeline
        stages' layers (in stage order)."""
        counts = counts.to(self.mesh.device)  # NCCL reduces device tensors only
        if isinstance(counts, RoutingVolatility) and self.mesh.layout.pp > 1:
            counts = counts.or_over_stages(self.mesh.pp_group)  # before the tokens of other ranks are summed
        for group in self.mesh.token_groups():  # the ranks that hold other tokens of the same layers
            counts = all_reduce(counts, group)
        counts = counts.to("cpu")
        if self.mesh.layout.pp > 1:
            gathered: list[Counts | None] = [None] * self.mesh.layout.pp
            dist.all_gather_object(gathered, counts, group=self.mesh.pp_group)
            counts = type(counts).concat_layers([p for p in gathered if p is not None])
        return counts


def _pairs(before: Routing, after: Routing) -> Pairs:
    """Two recordings of the same micro-batches, per micro-batch as [tokens, layers, k] each."""
    return [(torch.stack(a, dim=1), torch.stack(b, dim=1)) for a, b in zip(before, after, strict=True)]


def _volatility(pairs: Pairs, masks: list[torch.Tensor]) -> RoutingVolatility:
    return RoutingVolatility.merge_all([routing_volatility(a, b, m) for (a, b), m in zip(pairs, masks, strict=True)])


def _rows_of_tokens(local: torch.Tensor, micro_batch: MicroBatch, mesh: ParallelMesh) -> torch.Tensor:
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


def _token_turns(micro_batch: StepMicroBatch, mesh: ParallelMesh, turns: int | None) -> torch.Tensor:
    """long [s_local * b] in megatron's token order (like ``_token_mask``): the turn whose engine call fed each
    input token, past ``turns - 1`` counted in the last (``turns`` None: uncapped); 0 for a single-turn sample,
    -1 where no engine call fed it (padding; a trajectory that ended before its first turn)."""
    of = micro_batch.input_turns
    if of is None:
        of = torch.zeros(micro_batch.num_rows, micro_batch.seq_len, dtype=torch.long)
    if turns is not None:
        of = of.clamp(max=turns - 1)
    of = split_sequence(of, mesh.layout.cp, mesh.cp_rank if mesh.layout.cp > 1 else 0)
    of = of.transpose(0, 1)  # [s, b]
    if mesh.layout.use_sequence_parallel and mesh.layout.tp > 1:
        of = of.chunk(mesh.layout.tp, dim=0)[mesh.tp_rank]
    return of.reshape(-1)


def _token_mask(micro_batch: StepMicroBatch, mesh: ParallelMesh) -> torch.Tensor:
    """bool [s_local * b] in megatron's token order: real (non-padding) input tokens."""
    mask = split_sequence(
        micro_batch.input_mask,
        mesh.layout.cp,
        mesh.cp_rank if mesh.layout.cp > 1 else 0,
    )
    mask = mask.bool().transpose(0, 1)  # [s, b]
    if mesh.layout.use_sequence_parallel and mesh.layout.tp > 1:
        mask = mask.chunk(mesh.layout.tp, dim=0)[mesh.tp_rank]
    return mask.reshape(-1)
