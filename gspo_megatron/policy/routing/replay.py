"""Routing Replay on megatron-core's own ``RouterReplay`` (the GSPO paper's GRPO baseline on MoE).

Modes (``routing.replay``):
- ``none``: routers choose freely in every forward;
- ``old_policy``: the old-log-prob pass RECORDs each MoE layer's top-k indices per micro-batch;
  every training forward of that batch REPLAYs them, so pi_theta and pi_old use the same experts;
- ``rollout`` (R3): the experts the rollout engine used (``Sample.routed_experts``) are replayed in
  the old-log-prob pass and in every training forward.

Design decisions:
- ``RoutingReplay`` owns the ``RouterReplay`` instances of *this* model (captured when the model is
  built), not megatron's process-global list, so two models in one process cannot mix.
- Recording appends per forward instead of overwriting (an instance-level override of
  ``record_indices``), because megatron keeps only the last call and a schedule runs many
  micro-batches. Forwards of one model chunk run in micro-batch order under every schedule, so
  a layer's n-th recorded entry belongs to the n-th micro-batch. Under virtual pipeline stages the
  chunks' forwards interleave: each instance knows its chunk (``chunk_of``) and ``before_forward(chunk)``
  moves only that chunk's routers on to their next micro-batch. ``restore()`` removes the overrides
  (the trainer's replay strategy calls it when the run closes).
- Bookkeeping is exact and checked: every recorded entry must be consumed exactly once by the
  training forwards of its batch (``assert_fully_consumed``).
- Indices are kept in megatron's token order: the router sees this rank's [s_local * b] tokens
  sequence-first (s_local = s / tp under sequence parallelism).
- Shared-prefix forwards (``trainer.shared_prefix``) route the packed layout's tokens; the forward gives each
  instance that layout's ``ROUTER_TOKEN_ORDER`` (``policy/models/shared_prefix_forward.py``) and what is recorded
  (indices, margins) is reordered by it into the row layout's [s * b] order, so every reader sees what it
  would without the packing. Replaying a packed forward is refused (config/validate.py refuses the pairing).
- Router fusion bypasses ``RouterReplay`` and is rejected together with replay.
- A replaying forward can also be *observed* (``load_targets(..., observe=True)``): the indices
  megatron's top-k actually returned to the dispatcher are recorded like a RECORD pass, so the
  engine-vs-trainer routing of an R3 forward is measured (0 when replay works), not assumed.
- A recording forward also keeps each token's top-k margin (the k-th minus the (k+1)-th score top-k
  ranked, ``policy/routing/topk_margin.py``), from the scores megatron hands ``get_replay_topk``:
  the indices alone cannot say how close a token was to another expert set.
- Replay keeps the router learning: megatron gathers the replayed experts' gate scores from the
  live *dense* router scores (``scores.gather(1, replayed)``, before any top-k masking), so a
  replayed expert outside the live top-k still gets a gate weight and a gradient
  (tests/distributed/test_routing_replay.py::test_replay_keeps_router_learning checks both).
"""

from __future__ import annotations

import torch

from gspo_megatron.core.config_node import ConfigChoice
from gspo_megatron.policy.models.shared_prefix_forward import ROUTER_TOKEN_ORDER
from gspo_megatron.policy.routing.topk_margin import topk_margin


class ReplayMode(ConfigChoice):
    """``routing.replay``: a closed choice, so Hydra refuses other values at compose time."""

    none = "none"
    old_policy = "old_policy"  # R2: replay the old-log-prob pass's routing in the training forwards
    rollout = "rollout"  # R3: replay the rollout engine's routed experts


REPLAY_MODES = tuple(ReplayMode)
_ABSENT = object()  # marks an attribute the instance did not have before it was patched


class ReplayError(RuntimeError):
    pass


def validate_replay_mode(mode: str, *, router_fusion: bool = False, recompute: bool = False, pp: int = 1) -> None:
    if mode not in REPLAY_MODES:
        raise ValueError(f"routing.replay={mode!r} is unknown; valid: {', '.join(REPLAY_MODES)}")
    if mode != ReplayMode.none and router_fusion:
        raise ValueError(
            "routing replay cannot be combined with router fusion (the fused kernel bypasses RouterReplay)"
        )
    if mode != ReplayMode.none and recompute and pp > 1:
        raise ValueError(
            "routing replay with activation recompute needs pp=1 (the 1F1B schedule recomputes a "
            "micro-batch after later forwards have replaced its replay targets)"
        )


class RoutingReplay:
    """The RouterReplay instances of this rank's model, in layer order (chunk by chunk under virtual stages);
    ``chunk_of[i]``: the model chunk instance i lives in (all 0 without virtual stages)."""

    def __init__(self, instances: list, chunk_of: list[int] | None = None):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.instances = list(instances)
        self.chunk_of = list(chunk_of) if chunk_of is not None else [0] * len(self.instances)
        if len(self.chunk_of) != len(self.instances):
            raise ReplayError(f"{len(self.chunk_of)} chunk indices for {len(self.instances)} routers")
        self.action = RouterReplayAction
        self._recorded: list[list[torch.Tensor]] = [[] for _ in self.instances]
        self._margins: list[list[torch.Tensor]] = [[] for _ in self.instances]  # per layer, per recorded forward
        self._targets: list[list[torch.Tensor]] = []  # per micro-batch: one tensor per layer
        self._consumed: dict[int, int] = {}  # chunk -> forwards that took their targets
        self._observe = False
        self._patched: list[tuple[object, str, object]] = []  # (instance, attribute, what it was)
        for layer, instance in enumerate(self.instances):
            self._patch(instance, "record_indices", self._recorder(layer))
            self._patch(instance, "get_replay_topk", self._observed_topk(layer, instance.get_replay_topk))

    def _patch(self, instance, name: str, value) -> None:
        self._patched.append((instance, name, vars(instance).get(name, _ABSENT)))
        setattr(instance, name, value)

    def restore(self) -> None:
        """Give megatron's instances back their own ``record_indices`` / ``get_replay_topk``."""
        self.stop()
        for instance, name, original in reversed(self._patched):
            if original is _ABSENT:
                delattr(instance, name)
            else:
                setattr(instance, name, original)
        self._patched = []

    @classmethod
    def capture_new_instances(cls, before: int, routers_per_chunk: list[int] | None = None) -> RoutingReplay:
        """The instances megatron created since the global list had ``before`` entries; built chunk after
        chunk, ``routers_per_chunk`` of them in each (None: one chunk)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        instances = RouterReplay.global_router_replay_instances[before:]
        chunk_of = None
        if routers_per_chunk is not None:
            chunk_of = [chunk for chunk, count in enumerate(routers_per_chunk) for _ in range(count)]
        return cls(instances, chunk_of)

    @staticmethod
    def instance_count() -> int:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        return len(RouterReplay.global_router_replay_instances)

    def _row_order(self, layer: int, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ([tokens, ...]) of a forward in the row layout's token order (module notes)."""
        given = getattr(self.instances[layer], ROUTER_TOKEN_ORDER, None)
        if given is None:
            return tokens
        order, packed_tokens = given
        if tokens.shape[0] != packed_tokens:
            raise ReplayError(
                f"a shared-prefix forward routed {tokens.shape[0]} tokens of its {packed_tokens} (sequence "
                "parallelism splits them): set trainer.shared_prefix=false or routing.enabled=false"
            )
        return tokens[order.to(tokens.device)]

    def _recorder(self, layer: int):
        def record(topk_indices: torch.Tensor) -> None:
            # kept on the CPU: small ([tokens, k] ints), compared and re-sent as replay targets later
            self._recorded[layer].append(self._row_order(layer, topk_indices.detach()).to("cpu", copy=True))

        return record

    def _observed_topk(self, layer: int, replay_topk):
        def topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.instances[layer].router_replay_action == self.action.RECORD and topk < scores.shape[-1]:
                self._margins[layer].append(self._row_order(layer, topk_margin(scores, topk)).to("cpu", copy=True))
            probs, indices = replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            if self._observe and self.instances[layer].router_replay_action == self.action.REPLAY_FORWARD:
                self._recorded[layer].append(indices.detach().to("cpu", copy=True))
            return probs, indices

        return topk

    # --- recording -----------------------------------------------------------------------
    def start_recording(self) -> None:
        self._recorded = [[] for _ in self.instances]
        self._margins = [[] for _ in self.instances]
        for instance in self.instances:
            instance.clear_indices()
            instance.set_router_replay_action(self.action.RECORD)

    def recorded(self) -> list[list[torch.Tensor]]:
        """recorded[micro_batch][layer] -> int [tokens, k]."""
        per_layer = self._recorded
        counts = {len(x) for x in per_layer}
        if len(counts) > 1:
            raise ReplayError(f"layers recorded different numbers of forwards: {sorted(counts)}")
        n = counts.pop() if counts else 0
        return [[per_layer[layer][mb] for layer in range(len(self.instances))] for mb in range(n)]

    def recorded_margins(self) -> list[list[torch.Tensor]]:
        """recorded_margins[micro_batch][layer] -> float [tokens]: the recording forwards' top-k margins
        (empty when every expert is chosen: no (k+1)-th score)."""
        per_layer = self._margins
        if any(len(x) != len(per_layer[0]) for x in per_layer):
            raise ReplayError(f"layers kept margins of different numbers of forwards: {[len(x) for x in per_layer]}")
        n = len(per_layer[0]) if per_layer else 0
        return [[per_layer[layer][mb] for layer in range(len(self.instances))] for mb in range(n)]

    # --- replaying -----------------------------------------------------------------------
    def load_targets(self, per_micro_batch: list[list[torch.Tensor]], observe: bool = False) -> None:
        """Queue replay targets: one list (one tensor per MoE layer) per upcoming forward.

        ``observe``: record the indices the replaying forwards actually routed with (``recorded()``).
        """
        for targets in per_micro_batch:
            if len(targets) != len(self.instances):
                raise ReplayError(f"{len(targets)} replay tensors for {len(self.instances)} MoE layers")
        self._targets = list(per_micro_batch)
        self._consumed = {chunk: 0 for chunk in self.chunk_of}
        self._observe = observe
        self._recorded = [[] for _ in self.instances]
        for instance in self.instances:
            instance.clear_indices()
            instance.set_router_replay_action(self.action.REPLAY_FORWARD)

    def before_forward(self, chunk: int = 0) -> None:
        """Called by the forward step: point model chunk ``chunk``'s layers at its next micro-batch's targets."""
        if not self._targets or chunk not in self._consumed:
            return
        consumed = self._consumed[chunk]
        if consumed >= len(self._targets):
            raise ReplayError(
                f"forward {consumed + 1} of model chunk {chunk} has no replay targets: only "
                f"{len(self._targets)} were recorded"
            )
        targets = self._targets[consumed]
        for instance, owner, target in zip(self.instances, self.chunk_of, targets, strict=True):
            if owner == chunk:
                instance.set_target_indices(target)
        self._consumed[chunk] = consumed + 1

    def assert_fully_consumed(self) -> None:
        short = {chunk: n for chunk, n in self._consumed.items() if n != len(self._targets)}
        if self._targets and short:
            counts = " and ".join(f"{n} of model chunk {chunk}'s" for chunk, n in short.items())
            if len(self._consumed) == 1:
                counts = str(next(iter(short.values())))
            raise ReplayError(f"{len(self._targets)} replay targets queued but {counts} forwards consumed them")

    def stop(self) -> None:
        for instance in self.instances:
            instance.clear_indices()
            instance.clear_router_replay_action()
        self._targets = []
        self._consumed = {}
        self._observe = False


def rollout_targets(
    routed: torch.Tensor,
    moe_layers: list[int],
    tp_rank: int,
    tp_size: int,
    sequence_parallel: bool,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> list[torch.Tensor]:
    """Engine routed experts [b, s, all_layers, k] -> per MoE layer [s_local * b, k] in megatron order.

    Under context parallelism the rows are first cut like the tokens (``split_sequence``)."""
    from gspo_megatron.policy.parallel.context_parallel import split_sequence

    if routed.dim() != 4:
        raise ReplayError(f"routed experts must be [batch, seq, layers, k], got {tuple(routed.shape)}")
    routed = split_sequence(routed, cp_size, cp_rank)
    b, s = routed.shape[:2]
    out = []
    for layer in moe_layers:
        per_token = routed[:, :, layer, :].transpose(0, 1)  # [s, b, k] sequence-first
        if sequence_parallel and tp_size > 1:
            per_token = per_token.chunk(tp_size, dim=0)[tp_rank]
        indices = per_token.reshape(-1, per_token.shape[-1]).long()
        if (indices < 0).any():
            raise ReplayError(f"routed experts of MoE layer {layer} contain negative ids (a dense layer?)")
        out.append(indices)
    return out


def moe_layer_indices(model_config) -> list[int]:
    dense = set(model_config.dense_layers)
    return [i for i in range(model_config.num_layers) if i not in dense] if model_config.is_moe else []


def layer_topk_to_tensor(per_layer: list[torch.Tensor], batch: int) -> torch.Tensor | None:
    """[tokens, k] per layer in megatron order (s-major) -> [b, s, layers, k]."""
    if not per_layer:
        return None
    stacked = torch.stack(per_layer, dim=1)  # [s*b, L, k]
    s = stacked.shape[0] // batch
    return stacked.reshape(s, batch, *stacked.shape[1:]).transpose(0, 1)
