"""Each rank's parameters, in megatron's order, and the DDP buffers and optimizer state built on them.

Design decisions:
- The parameter list of a pipeline stage is derived from the model shape and the layout alone, in
  the order ``GPTModel.named_parameters()`` yields it with this project's portable layer spec
  (``policy/models/builder.py``), so megatron's buffer layout can be replayed exactly: with the
  distributed optimizer every parameter starts at a multiple of 64 elements and every bucket ends
  at a multiple of lcm(dp, 128) (``megatron/core/distributed/param_and_grad_buffer.py``). The TE
  spec fuses the norms into the linear layers; the counts are the same, padding may differ by < 64
  elements per parameter.
- Expert parameters go to their own buffer, sharded over the expert-data-parallel group, exactly when
  ep > 1 (megatron marks them ``allreduce=False`` then); with ep = 1 they share the dense buffer.
- Optimizer state (Adam): two fp32 moments per parameter element the rank owns, plus an fp32 master
  copy when the parameters are bf16 (the precision-aware optimizer's ``optimizer.main_params_dtype`` /
  ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` set those widths: ``StateWidths``). Without the distributed
  optimizer a rank owns all its parameters; with it, its contiguous 1/dp slice of each bucket (padding
  owns nothing), and fp32 parameters are their own master copy (a view, no extra bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.parallel.layout import ParallelLayout

FP32 = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class StateWidths:
    """Bytes per owned element of the optimizer's master weights and Adam's two moments."""

    master: int = FP32
    exp_avg: int = FP32
    exp_avg_sq: int = FP32

    @property
    def moments(self) -> int:
        return self.exp_avg + self.exp_avg_sq


@dataclass(frozen=True)
class ParamSpec:
    name: str
    numel: int
    expert: bool  # lives in the expert-parallel buffer (ep > 1)
    norm: bool = False  # an RMSNorm weight (in the model dtype, like every weight: policy/models/layers.py)
    shared_embedding: bool = False  # tied output layer on a later stage: its own bucket (dist. opt.)


def stage_layers(model: MoEModelConfig, layout: ParallelLayout, pp_rank: int) -> list[int]:
    return layout.stage_layers(model.num_layers, pp_rank)


_CACHE: dict[tuple, object] = {}  # the ranking tool asks for the same stage many times


def _cached(key: tuple, build):
    if key not in _CACHE:
        if len(_CACHE) > 4096:
            _CACHE.clear()
        _CACHE[key] = build()
    return _CACHE[key]


def stage_parameters(model: MoEModelConfig, layout: ParallelLayout, pp_rank: int) -> list[ParamSpec]:
    """The parameters one rank of pipeline stage ``pp_rank`` holds, in ``named_parameters()`` order."""
    key = ("params", repr(model), layout, pp_rank)
    return _cached(key, lambda: _stage_parameters(model, layout, pp_rank))


def _stage_parameters(model: MoEModelConfig, layout: ParallelLayout, pp_rank: int) -> list[ParamSpec]:
    h, d, tp, etp = model.hidden_size, model.head_dim, layout.tp, layout.expert_tp
    expert_buffer = layout.ep > 1
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    params: list[ParamSpec] = []

    def add(name: str, numel: int, expert: bool = False, shared: bool = False) -> None:
        params.append(ParamSpec(name, numel, expert and expert_buffer, name.endswith("norm.weight"), shared))

    if first:
        add("embedding.word_embeddings.weight", model.vocab_size // tp * h)
    dense = set(model.dense_layers)
    linear = set(model.linear_attention_layers)
    for i in stage_layers(model, layout, pp_rank):
        p = f"decoder.layers.{i}."
        q_width = model.num_attention_heads * d // tp
        # attention_output_gate: linear_qkv also makes a per-head gate as wide as the queries
        q_rows = (2 if model.attention_output_gate else 1) * model.num_attention_heads * d
        qkv_rows = (q_rows + 2 * model.num_kv_heads * d) // tp
        add(p + "input_layernorm.weight", h)
        if i in linear:
            for name, numel in gated_delta_net_parameters(model, tp):
                add(p + "self_attention." + name, numel)
        elif model.attention == "mla":
            for name, numel in _mla_parameters(model, tp):
                add(p + "self_attention." + name, numel)
        else:
            add(p + "self_attention.linear_proj.weight", h * q_width)
            add(p + "self_attention.linear_qkv.weight", qkv_rows * h)
            if model.qkv_bias:
                add(p + "self_attention.linear_qkv.bias", qkv_rows)
            if model.qk_norm:
                q_norm, k_norm = model.qk_norm_widths()  # whole on every TP rank (OLMoE's too)
                add(p + "self_attention.q_layernorm.weight", q_norm)
                add(p + "self_attention.k_layernorm.weight", k_norm)
        add(p + "pre_mlp_layernorm.weight", h)
        if i in dense or not model.is_moe:
            ffn = model.dense_intermediate_size // tp
            add(p + "mlp.linear_fc1.weight", 2 * ffn * h)
            add(p + "mlp.linear_fc2.weight", h * ffn)
            continue
        add(p + "mlp.router.weight", model.num_experts * h)
        ffn = model.moe_intermediate_size // etp
        for j in range(model.num_experts // layout.ep):
            add(p + f"mlp.experts.local_experts.{j}.linear_fc1.weight", 2 * ffn * h, expert=True)
            add(p + f"mlp.experts.local_experts.{j}.linear_fc2.weight", h * ffn, expert=True)
        if model.shared_expert_intermediate_size:
            sffn = model.shared_expert_intermediate_size // tp
            if model.architecture.shared_expert_gated:  # megatron's SharedExpertMLP registers its gate first
                add(p + "mlp.shared_experts.gate_weight", h)
            add(p + "mlp.shared_experts.linear_fc1.weight", 2 * sffn * h)
            add(p + "mlp.shared_experts.linear_fc2.weight", h * sffn)
    if last:
        add("decoder.final_layernorm.weight", h)
        if not model.tie_word_embeddings:
            add("output_layer.weight", model.vocab_size // tp * h)
        elif not first:
            add("output_layer.weight", model.vocab_size // tp * h, shared=True)
    return params


def gated_delta_net_parameters(model: MoEModelConfig, tp: int) -> list[tuple[str, int]]:
    """One gated DeltaNet layer's parameters on one TP rank, in megatron's ``named_parameters()`` order
    (``megatron/core/ssm/gated_delta_net.py``: the module's own ``dt_bias`` and ``A_log`` [value heads / tp]
    first, then its submodules as registered: the column-parallel ``in_proj`` [(2 q/k width + 2 v width +
    2 value heads) / tp, h] (q, k, v, the output gate z, b and a fused), the depthwise ``conv1d``
    [(2 q/k width + v width) / tp, 1, kernel] (no bias), the gated RMSNorm ``out_norm`` [value head dim]
    (whole on every rank) and the row-parallel ``out_proj`` [h, v width / tp])."""
    h, heads = model.hidden_size, model.linear_num_value_heads
    key_width = model.linear_num_key_heads * model.linear_key_head_dim
    value_width = heads * model.linear_value_head_dim
    conv_channels = 2 * key_width + value_width
    return [
        ("dt_bias", heads // tp),
        ("A_log", heads // tp),
        ("in_proj.weight", (conv_channels + value_width + 2 * heads) // tp * h),
        ("conv1d.weight", conv_channels // tp * model.linear_conv_kernel_dim),
        ("out_norm.weight", model.linear_value_head_dim),
        ("out_proj.weight", h * value_width // tp),
    ]


def _mla_parameters(model: MoEModelConfig, tp: int) -> list[tuple[str, int]]:
    """Multi-latent attention's parameters on one TP rank, in megatron's order (its local spec: every
    projection column-parallel, the down projections too, gathered after; the TE spec's duplicated down
    projections hold tp x these rows, under 1% of a DeepSeek-V3 layer)."""
    h, heads = model.hidden_size, model.num_attention_heads // tp
    out = [("linear_proj.weight", h * heads * model.v_head_dim)]
    if model.q_lora_rank:
        out += [
            ("linear_q_down_proj.weight", model.q_lora_rank // tp * h),
            ("linear_q_up_proj.weight", heads * model.head_dim * model.q_lora_rank),
        ]
    else:
        out.append(("linear_q_proj.weight", heads * model.head_dim * h))
    out += [
        ("linear_kv_down_proj.weight", (model.kv_lora_rank + model.qk_rope_head_dim) // tp * h),
        ("linear_kv_up_proj.weight", heads * (model.qk_nope_head_dim + model.v_head_dim) * model.kv_lora_rank),
    ]
    if model.q_lora_rank:
        out.append(("q_layernorm.weight", model.q_lora_rank))
    return out + [("kv_layernorm.weight", model.kv_lora_rank)]


@dataclass(frozen=True)
class BufferLayout:
    """One megatron ``_ParamAndGradBuffer``: its padded size and each bucket's [start, end)."""

    numel: int
    buckets: tuple[tuple[int, int], ...]
    param_ranges: tuple[tuple[int, int, int], ...]  # (start, end, bucket) per parameter, buffer order
    dp: int  # the group the buffer is reduced (and, with the distributed optimizer, sharded) over
    width: int = FP32  # bytes per parameter element
    expert: bool = False


def buffer_layout(
    params: list[ParamSpec],
    dp: int,
    distributed_optimizer: bool,
    bucket_size: int | None = None,
    width: int = FP32,
    expert: bool = False,
) -> BufferLayout:
    """Replays ``_ParamAndGradBuffer.__init__``: parameters in reverse order, padding as megatron pads."""

    def pad(n: int, divisor: int) -> int:
        return -(-n // divisor) * divisor

    def bucket_end(n: int) -> int:
        return pad(n, lcm(dp, 128)) if distributed_optimizer else n

    start = bucket_start = 0
    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int, int]] = []
    in_bucket = 0
    end = 0
    for param in reversed(params):
        if distributed_optimizer:
            start = pad(start, 64)
        own_bucket = param.shared_embedding and distributed_optimizer
        if own_bucket and in_bucket:
            closed = bucket_end(start)
            buckets.append((bucket_start, closed))
            bucket_start, start, in_bucket = closed, closed, 0
        end = start + param.numel
        ranges.append((start, end, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            closed = bucket_end(end)
            buckets.append((bucket_start, closed))
            bucket_start, start, in_bucket = closed, closed, 0
        else:
            start = end
    if in_bucket:
        buckets.append((bucket_start, bucket_end(end)))
    numel = buckets[-1][1] if buckets else 0
    return BufferLayout(numel, tuple(buckets), tuple(ranges), dp, width, expert)


def owned_elements(buffer: BufferLayout, dp_rank: int) -> int:
    """Parameter elements inside this rank's 1/dp slice of every bucket (distributed optimizer)."""
    owned = 0
    for start, end, bucket in buffer.param_ranges:
        b_start, b_end = buffer.buckets[bucket]
        shard = (b_end - b_start) // buffer.dp
        lo, hi = b_start + dp_rank * shard, b_start + (dp_rank + 1) * shard
        owned += max(0, min(end, hi) - max(start, lo))
    return owned


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state one rank allocates: weights, DDP grad (+param) buffers, optimizer state."""

    parameters: int
    gradients: int  # megatron DDP grad buffers (fp32: grad_reduce_in_fp32)
    param_buffers: int  # DDP param buffers: only with the distributed optimizer (weights live there)
    optimizer: int  # Adam moments + fp32 master weights

    @property
    def total(self) -> int:
        # With the distributed optimizer the weights *are* views into the param buffer.
        return self.parameters + self.gradients + self.optimizer


def param_width(param: ParamSpec, dtype: str) -> int:
    """Bytes per element of a weight: the model dtype for every weight, norms included (the portable
    RMSNorm is built in the model dtype, as TE's is)."""
    return DTYPE_BYTES[dtype]


def rank_buffers(
    model: MoEModelConfig,
    layout: ParallelLayout,
    pp_rank: int,
    distributed_optimizer: bool,
    dtype: str = "float32",
    bucket_size: int | None = None,
) -> list[BufferLayout]:
    """Megatron's buffers for one rank: megatron groups a stage's parameters by
    (expert?, parameter dtype) in first-appearance order; dense buffers reduce over dp*cp, expert
    buffers (ep > 1) over expert-dp."""
    key = ("buffers", repr(model), layout, pp_rank, distributed_optimizer, dtype, bucket_size)
    return _cached(key, lambda: _rank_buffers(model, layout, pp_rank, distributed_optimizer, dtype, bucket_size))


def _rank_buffers(
    model: MoEModelConfig,
    layout: ParallelLayout,
    pp_rank: int,
    distributed_optimizer: bool,
    dtype: str,
    bucket_size: int | None,
) -> list[BufferLayout]:
    groups: dict[tuple[bool, int], list[ParamSpec]] = {}
    for param in stage_parameters(model, layout, pp_rank):
        groups.setdefault((param.expert, param_width(param, dtype)), []).append(param)
    ordered = [key for key in groups if not key[0]] + [key for key in groups if key[0]]
    out = []
    for expert, width in ordered:
        dp = layout.expert_dp if expert else layout.dp * layout.cp
        params = groups[(expert, width)]
        out.append(buffer_layout(params, dp, distributed_optimizer, bucket_size, width, expert))
    return out


def state_bytes(
    model: MoEModelConfig,
    layout: ParallelLayout,
    pp_rank: int,
    *,
    dtype: str = "bfloat16",
    distributed_optimizer: bool,
    dp_rank: int = 0,
    expert_dp_rank: int = 0,
    bucket_size: int | None = None,
    widths: StateWidths = StateWidths(),
) -> StateBytes:
    """Exact bytes of one rank's weights, gradient buffers and Adam state (megatron-core 0.16); ``widths``:
    the optimizer state's dtypes (fp32 unless the precision-aware optimizer is given others)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    params = stage_parameters(model, layout, pp_rank)
    weights = sum(p.numel * param_width(p, dtype) for p in params)
    buffers = rank_buffers(model, layout, pp_rank, distributed_optimizer, dtype, bucket_size)
    grads = sum(b.numel for b in buffers) * FP32
    if not distributed_optimizer:
        moments = sum(p.numel for p in params) * widths.moments
        master = sum(p.numel * widths.master for p in params if param_width(p, dtype) != FP32)
        return StateBytes(weights, grads, 0, moments + master)
    owned_moments = owned_master = 0
    for buffer in buffers:
        owned = owned_elements(buffer, expert_dp_rank if buffer.expert else dp_rank)
        owned_moments += owned * widths.moments
        owned_master += owned * widths.master if buffer.width != FP32 else 0
    param_buffers = sum(b.numel * b.width for b in buffers)
    return StateBytes(param_buffers, grads, param_buffers, owned_moments + owned_master)
