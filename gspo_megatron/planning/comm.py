"""Per-step communication volume of one rank, by kind, and the time it takes on the stated links.

Design decisions:
- Volumes are *payloads*: the bytes of the full tensor a collective is about (the gathered tensor of
  an all-gather, the input of a reduce-scatter or all-reduce, the send buffer of an all-to-all, the
  tensor of a send). Bytes on the wire follow from the collective's algorithm (ring: all-gather and
  reduce-scatter move (n-1)/n of the payload per rank, all-reduce 2(n-1)/n, all-to-all (n-1)/n);
  ``Traffic.wire_bytes`` applies that, the time model divides by the link the group spans.
- Counted per micro-batch and layer as megatron-core issues them with sequence parallelism:
  a column-parallel linear all-gathers its input [T, h] forward and again in backward (for the weight
  gradient) and reduce-scatters its input gradient; a row-parallel linear reduce-scatters forward and
  all-gathers the output gradient in backward: 5 [T, h] collectives per attention block.
- MoE dispatch (``model.token_dispatcher``): with the ``alltoall`` dispatcher (the default) each of
  the T_sp*k routed rows of h crosses the EP group in dispatch and combine, forward and backward (4
  all-to-alls of T_sp k h; an estimate: the routing probabilities' all-to-alls and the token-count
  all-gather are left out, and only the allgather dispatcher's payloads are checked against gloo).
  With the ``allgather`` dispatcher the tokens of the whole TP x EP group are all-gathered forward and
  reduce-scattered back, and the reverse in backward (4 collectives of [T_sp tp ep, h]), plus the
  gathered routing probabilities (fp32, gathered and their gradient scattered) and routing map (bool).
- With sequence parallelism the first stage reduce-scatters the embedding output (and all-gathers its
  gradient); the last stage's output layer is a column-parallel linear (AG forward, AG + RS backward).
- PP: each micro-batch sends its [T_sp, h] activation forward and its gradient backward per stage
  boundary. DP: one all-reduce of every grad buffer per step (reduce-scatter + param all-gather with
  the distributed optimizer), payload = the padded buffer. CP: ring attention passes each rank's K and
  V around the CP ring, cp - 1 hops forward, twice that backward (dK, dV too).
- Per step, ``finalize_model_grads`` all-reduces over TP the fp32 gradients of parameters every TP
  rank holds whole (norms and routers under sequence parallelism; q/k norms always).
- Weight sync (trainer -> rollout engine): every parameter once per step in bf16, from the ranks that
  own it; counted as the whole model divided over the ranks that hold distinct shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_megatron.models.config import MoEModelConfig
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.planning.activations import MicroBatchShape
from gspo_megatron.planning.parameters import rank_buffers, stage_parameters

FP32 = 4


WIRE_FACTOR = {  # ring algorithms: bytes each rank sends per payload byte, for a group of n
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


@dataclass
class Traffic:
    """Payload bytes per (kind, collective), with the group size of each kind."""

    payload: dict[tuple[str, str], float] = field(default_factory=dict)
    group_size: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, collective: str, group: int, payload: float) -> None:
        if group <= 1 or payload <= 0:
            return
        self.payload[(kind, collective)] = self.payload.get((kind, collective), 0.0) + payload
        self.group_size[kind] = group

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (kind, _), payload in self.payload.items():
            out[kind] = out.get(kind, 0.0) + payload
        return out

    def wire_bytes(self, kind: str) -> float:
        n = self.group_size[kind]
        return sum(p * WIRE_FACTOR[c](n) for (k, c), p in self.payload.items() if k == kind)


def step_traffic(
    model: MoEModelConfig,
    layout: ParallelLayout,
    micro: MicroBatchShape,
    micro_batches: int,
    *,
    pp_rank: int = 0,
    width: int = 2,
    dispatcher: str = "alltoall",
    distributed_optimizer: bool = True,
    dtype: str = "bfloat16",
) -> Traffic:
    """What one rank of stage ``pp_rank`` moves in one optimizer step of ``micro_batches`` micro-batches."""
    from gspo_megatron.planning.parameters import stage_layers

    traffic = Traffic()
    tp, ep, etp = layout.tp, layout.ep, layout.expert_tp
    h = model.hidden_size
    tokens = micro.tokens / layout.cp
    sp_tokens = tokens / tp if layout.use_sequence_parallel else tokens
    layers = list(stage_layers(model, layout, pp_rank))
    moe_layers = [i for i in layers if i not in set(model.dense_layers)] if model.is_moe else []
    per_mb = Traffic()
    dense_tp_blocks = len(layers) + (len(layers) - len(moe_layers))  # attention + dense MLP blocks
    if layout.use_sequence_parallel:
        # column linear: AG fwd, AG + RS bwd; row linear: RS fwd, AG bwd
        per_mb.add("tp", "all_gather", tp, 3 * dense_tp_blocks * tokens * h * width)
        per_mb.add("tp", "reduce_scatter", tp, 2 * dense_tp_blocks * tokens * h * width)
        if pp_rank == layout.pp - 1:  # output layer (column parallel): AG fwd, AG + RS bwd
            per_mb.add("tp", "all_gather", tp, 2 * tokens * h * width)
            per_mb.add("tp", "reduce_scatter", tp, tokens * h * width)
        if pp_rank == 0:  # embedding output reduce-scattered to the sequence shards; AG of its grad
            per_mb.add("tp", "reduce_scatter", tp, tokens * h * width)
            per_mb.add("tp", "all_gather", tp, tokens * h * width)
    if pp_rank == layout.pp - 1:  # vocab-parallel log-prob statistics: [tp, T, 4] fp32
        per_mb.add("tp", "all_gather", tp, tp * tokens * 4 * FP32)
    for _ in moe_layers:
        rows = sp_tokens * model.top_k
        if dispatcher == "alltoall":
            per_mb.add("ep", "all_to_all", ep, 4 * rows * h * width)
            per_mb.add("etp", "all_gather", etp, 2 * rows * etp * h * width)
            per_mb.add("etp", "reduce_scatter", etp, 2 * rows * etp * h * width)
        else:  # hidden AG + combine RS forward, the reverse backward; probs (fp32) and routing map (bool)
            gathered = sp_tokens * tp * ep
            per_mb.add("tp_ep", "all_gather", tp * ep, 2 * gathered * h * width)
            per_mb.add("tp_ep", "reduce_scatter", tp * ep, 2 * gathered * h * width)
            per_mb.add("tp_ep", "all_gather", tp * ep, gathered * model.num_experts * (FP32 + 1))
            per_mb.add("tp_ep", "reduce_scatter", tp * ep, gathered * model.num_experts * FP32)
    if layout.cp > 1:
        kv = 2 * tokens * model.num_kv_heads * model.head_dim / tp * width
        per_mb.add("cp", "send_recv", layout.cp, len(layers) * 3 * (layout.cp - 1) * kv)
    boundaries = (pp_rank > 0) + (pp_rank < layout.pp - 1)
    per_mb.add("pp", "send_recv", layout.pp, 2 * boundaries * sp_tokens * h * width)
    for (kind, collective), payload in per_mb.payload.items():
        traffic.add(kind, collective, per_mb.group_size[kind], payload * micro_batches)
    # finalize_model_grads: one all-reduce over TP of the fp32 grads of the sequence-parallel
    # parameters (norms, routers, shared-expert gates) and of the q/k norms
    sp = layout.use_sequence_parallel
    replicated = [
        p
        for p in stage_parameters(model, layout, pp_rank)
        if p.norm
        and ("q_layernorm" in p.name or "k_layernorm" in p.name or sp)
        or sp
        and p.name.endswith(("router.weight", "gate_weight"))
    ]
    traffic.add("tp", "all_reduce", tp, sum(p.numel for p in replicated) * FP32)
    for buffer in rank_buffers(model, layout, pp_rank, distributed_optimizer, dtype):
        kind = "dp_expert" if buffer.expert else "dp"
        grads = buffer.numel * FP32
        if distributed_optimizer:
            traffic.add(kind, "reduce_scatter", buffer.dp, grads)
            traffic.add(kind, "all_gather", buffer.dp, buffer.numel * buffer.width)
        else:
            traffic.add(kind, "all_reduce", buffer.dp, grads)
    return traffic


def weight_sync_bytes(model: MoEModelConfig, width: int = 2) -> float:
    """Bytes the trainer sends the rollout engine per step: every parameter once, bf16."""
    return model.parameter_count()["total"] * width
