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
- Weight sync (trainer -> rollout engine), as built (``trainer/weight_stream.py``,
  ``rollout/sglang/engine.py``): every HF tensor once per step in bf16, gathered inside its stage and
  broadcast to the driver, which alone sends it to the engine in greedy buckets of ``bucket_bytes``
  (one ``/update_weights_from_distributed`` each). All bytes cross the driver's one link, so the time
  is the model over that link; the driver holds the bucket being filled plus the tensor being
  gathered: at most ``bucket_bytes + largest tensor`` (measured on gloo:
  tests/distributed/test_weight_sync_memory.py). Senders per PP stage / EP rank are not built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gspo_megatron.models.config import MoEModelConfig
from gspo_megatron.models.hf_shapes import hf_shapes
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
    # each of the rank's virtual chunks receives and sends, except the model's first and last
    boundaries = 2 * getattr(layout, "vpp", 1) - (pp_rank == 0) - (pp_rank == layout.pp - 1)
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


@dataclass(frozen=True)
class WeightSyncPlan:
    """One trainer -> engine weight sync: bytes, buckets, the driver's extra memory and the time."""

    bytes: float  # every HF tensor once
    buckets: int  # greedy buckets in export order (HTTP calls per server)
    driver_extra_bytes: float  # the bucket being filled + the tensor being gathered
    seconds: float  # all bytes over the driver's link

    def describe(self) -> str:
        return (
            f"{self.bytes / 1e9:.1f} GB in {self.buckets} buckets, sent by the driver alone; "
            f"~{self.seconds:.2f} s over its link; driver holds <= {self.driver_extra_bytes / 2**30:.2f} GiB extra"
        )


def weight_sync_plan(
    model: MoEModelConfig, bucket_bytes: int, link_bytes_per_s: float, width: int = 2
) -> WeightSyncPlan:
    """The sync as ``weights.named_tensors.bucket_named_tensors`` packs the export: a bucket closes when
    the next tensor would overflow it, an oversize tensor travels alone. Order: HF names by unit (the
    export's order up to the order of parameters inside a layer)."""
    sizes = [math.prod(shape) * width for shape in hf_shapes(model).values()]
    buckets, filled = 0, 0
    for size in sizes:
        if filled and filled + size > bucket_bytes:
            buckets, filled = buckets + 1, 0
        filled += size
    buckets += 1 if filled else 0
    total = float(sum(sizes))
    # the bucket is closed only when the next tensor has been gathered: (< bucket) + that tensor
    return WeightSyncPlan(total, buckets, float(bucket_bytes + max(sizes)), total / link_bytes_per_s)
