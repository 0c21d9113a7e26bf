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
- Weight sync (trainer -> rollout engine), as built (``loop/weight_sync.py``,
  ``rollout/sglang/stage_turns.py``, ``rollout/sglang/group_sender.py``): every HF tensor once per step in
  bf16, in greedy buckets of ``bucket_bytes`` (one ``/update_weights_from_distributed`` each), on one link
  per sender. ``weight_senders=driver``: each tensor is gathered inside its stage, broadcast over the
  pipeline group to the driver, which alone sends it: the driver's link carries the model out and the
  other stages' (pp-1)/pp of it in, one after the other (the export gathers the next tensor only after
  the bucket has left). ``per_stage`` (pp > 1): stage k's first rank sends its own units over its own
  group -- no pipeline hop, each sender's link carries its stage only -- but the stages take turns:
  SGLang receives a distributed update inside its scheduler loop, one at a time per server, and every
  server rank takes every group's broadcast of full tensors, so the servers' side is the model over one
  link whatever the number of senders. The sync time is therefore the sum of the senders' times (= the
  model over one link), each sender's share the max of which is printed beside it. A sender holds the
  bucket being filled plus the tensor being gathered: at most ``bucket_bytes + largest tensor`` (measured
  on gloo: tests/distributed/test_weight_sync_memory.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.models.hf_shapes import hf_shapes
from gspo_megatron.policy.parallel.layout import ParallelLayout
from planning.activations import MicroBatchShape
from planning.parameters import rank_buffers, stage_parameters

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
    from planning.parameters import stage_layers

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
    """One trainer -> engine weight sync: bytes, buckets, the senders' extra memory and the time."""

    bytes: float  # every HF tensor once
    buckets: int  # greedy buckets in export order (HTTP calls per server)
    driver_extra_bytes: float  # a sender's bucket being filled + the tensor being gathered
    seconds: float  # the sync: the senders' turns one after the other (+ the pipeline hop, driver only)
    sender_seconds: tuple[float, ...] = ()  # per pipeline stage's sender (per_stage), else the driver's alone
    pipeline_hop_seconds: float = 0.0  # driver only: the other stages' tensors into the driver's link

    def describe(self) -> str:
        size = f"{self.bytes / 1e9:.1f} GB in {self.buckets} buckets"
        held = f"a sender holds <= {self.driver_extra_bytes / 2**30:.2f} GiB extra"
        if len(self.sender_seconds) > 1:
            each = ", ".join(f"{s:.2f}" for s in self.sender_seconds)
            return (
                f"{size}, sent by {len(self.sender_seconds)} pipeline-stage senders (each its own stage: "
                f"[{each}] s, max {max(self.sender_seconds):.2f} s); ~{self.seconds:.2f} s in all: the stages take "
                f"turns because SGLang receives one distributed update at a time per server; {held}"
            )
        if not self.pipeline_hop_seconds:
            return f"{size}, sent by the driver alone; ~{self.seconds:.2f} s over its link; {held}"
        hop, send = self.pipeline_hop_seconds, self.seconds - self.pipeline_hop_seconds
        return (
            f"{size}, sent by the driver alone; ~{self.seconds:.2f} s: {hop:.2f} s receiving the other stages' "
            f"tensors, then {send:.2f} s sending over its link; {held}"
        )


def weight_sync_plan(
    model: MoEModelConfig,
    bucket_bytes: int,
    link_bytes_per_s: float,
    width: int = 2,
    layout: ParallelLayout | None = None,
    senders: str = "per_stage",
) -> WeightSyncPlan:
    """The sync as ``core/named_tensors.py:bucket_named_tensors`` packs the export: a bucket closes when
    the next tensor would overflow it, an oversize tensor travels alone (per sender). Order: HF names by
    unit (the export's order up to the order of parameters inside a layer). ``layout``'s pipeline stages
    decide the senders (``senders``: ``rollout.sglang.weight_senders``)."""
    shapes = hf_shapes(model)
    pp = layout.pp if layout is not None else 1
    stages = _stages(shapes, model, layout) if layout is not None and pp > 1 else [0] * len(shapes)
    sizes = [math.prod(shape) * width for shape in shapes.values()]
    per_stage = senders == "per_stage" and pp > 1
    groups = (
        [[s for s, stage in zip(sizes, stages, strict=True) if stage == k] for k in range(pp)] if per_stage else [sizes]
    )
    total = float(sum(sizes))
    sender_seconds = tuple(sum(group) / link_bytes_per_s for group in groups)
    hop = 0.0 if per_stage else sum(s for s, stage in zip(sizes, stages, strict=True) if stage > 0) / link_bytes_per_s
    # the bucket is closed only when the next tensor has been gathered: (< bucket) + that tensor
    return WeightSyncPlan(
        total,
        sum(_buckets(group, bucket_bytes) for group in groups),
        float(bucket_bytes + max(sizes)),
        sum(sender_seconds) + hop,
        sender_seconds,
        hop,
    )


def _buckets(sizes: list[int], bucket_bytes: int) -> int:
    buckets, filled = 0, 0
    for size in sizes:
        if filled and filled + size > bucket_bytes:
            buckets, filled = buckets + 1, 0
        filled += size
    return buckets + (1 if filled else 0)


def _stages(shapes: dict, model: MoEModelConfig, layout: ParallelLayout) -> list[int]:
    """The pipeline stage whose rank holds each HF tensor (embedding: first; final norm, head: last)."""
    stage_of_layer = {layer: k for k in range(layout.pp) for layer in layout.stage_layers(model.num_layers, k)}
    out = []
    for name in shapes:
        if name.startswith("model.layers."):
            out.append(stage_of_layer[int(name.split(".")[2])])
        else:
            out.append(0 if "embed_tokens" in name else layout.pp - 1)
    return out
