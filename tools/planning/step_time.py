"""Step-time estimate of one optimizer step: matmul FLOPs at an assumed fraction of the bf16 peak,
exposed communication on the link each group spans, and the 1F1B pipeline bubble.

Design decisions (all stated, all approximate; nothing here was timed on a GPU):
- FLOPs per token and layer on one rank: 2 x (the weights it multiplies) for the linears, with
  experts counted for the rows this rank actually computes (T_sp * etp * k rows of 6 h F), plus
  causal attention 2 * 2 * (s/2) * heads/tp * d (a gated full-attention layer's q projection twice as
  wide: its output gate). A gated DeltaNet layer instead: its in/out projections 2 h (C + 2V + 2H) for
  C = (2 key width + V) conv channels, V value width, H value heads (all / tp), the conv 2 C kernel, and
  the chunked delta rule (FLA, chunks of 64): the state's read, correction and update 3 x 2 H dk dv plus
  the intra-chunk products 2 x 2 x 64 H (dk + dv) per token -- linear in s, no s^2 term. Backward = 2 x
  forward; full recompute adds one forward.
- Communication is *not* overlapped with compute (megatron can overlap DP reduction and, with the
  alltoall dispatcher, some EP traffic; the trainer here runs with overlap_grad_reduce=False), so
  the estimate is an upper bound on the communication share.
- A group uses NVLink when all its ranks sit in one node (megatron's rank order: tp fastest, then
  cp, dp, pp; the expert mesh etp, ep, expert-dp, pp), else InfiniBand.
- Pipeline: (m + pp - 1) micro-batch slots for m micro-batches (the 1F1B bubble), each as long as
  the slowest stage's forward + backward.
- The band: ``lower_s`` hides all model-parallel communication behind compute (perfect overlap; the
  DP reduction stays exposed: ``overlap_grad_reduce=False``), ``total_s`` hides none. How much a
  real run overlaps is not known here, so two layouts whose bands overlap are not told apart.
- A forward-only pass (old log-probs, reference log-probs) costs one forward per micro-batch plus
  half the per-micro-batch traffic (forward issues 2 of a linear pair's 5 TP collectives, 2 of 4
  all-to-alls, 1 of 2 pipeline sends: half is the upper end).
- The RL step (``rl_step_time``) is rollout + old-log-prob pass + reference pass + k updates +
  weight sync, in that order (the trainer's phases). Rollout on separate engine GPUs overlaps the
  training phases only with ``rollout.async_rollout``. Rollout time is a roofline lower bound:
  decode steps of the whole batch, each reading the weights the batch touches and its KV cache at
  the full HBM bandwidth, or computing 2 x active parameters per token at ``mfu``, whichever is
  longer; prefill at ``mfu``. No engine was timed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.parallel.layout import ParallelLayout
from planning.activations import MicroBatchShape
from planning.comm import Traffic
from planning.hardware import GPUSpec
from planning.parameters import stage_layers
from planning.pipeline import bubble_slots
from planning.rl_step_memory import linear_state_bytes


def forward_flops(
    model: MoEModelConfig,
    layout: ParallelLayout,
    micro: MicroBatchShape,
    pp_rank: int,
    expert_imbalance: float = 1.0,
) -> float:
    """Forward matmul FLOPs of one micro-batch on one rank of stage ``pp_rank``; the expert rows of the
    busiest expert-parallel rank are ``expert_imbalance`` x the balanced share (1: uniform routing;
    ``calibrate.py`` measures it from the trainer's expert loads)."""
    tp, etp = layout.tp, layout.expert_tp
    h, d = model.hidden_size, model.head_dim
    tokens = micro.tokens / layout.cp
    sp_tokens = tokens / tp if layout.use_sequence_parallel else tokens
    q, kv = model.num_attention_heads * d / tp, model.num_kv_heads * d / tp
    q_rows = 2 * q if model.attention_output_gate else q  # the output gate's rows in linear_qkv
    dense, linear = set(model.dense_layers), set(model.linear_attention_layers)
    flops = 0.0
    for i in stage_layers(model, layout, pp_rank):
        if i in linear:
            flops += linear_attention_flops(model, tp, tokens)
        else:
            flops += 2 * tokens * h * (q_rows + 2 * kv) + 2 * tokens * q * h  # qkv + output projection
            flops += 2 * 2 * tokens * (micro.seq_len / 2) * q  # causal scores + weighted values
        if i in dense or not model.is_moe:
            flops += 6 * tokens * h * model.dense_intermediate_size / tp
            continue
        flops += 2 * sp_tokens * h * model.num_experts  # router
        flops += 6 * sp_tokens * etp * model.top_k * h * model.moe_intermediate_size / etp * expert_imbalance
        flops += 6 * tokens * h * model.shared_expert_intermediate_size / tp
    if pp_rank == layout.pp - 1:
        flops += 2 * tokens * h * model.vocab_size / tp
    return flops


def linear_attention_flops(model: MoEModelConfig, tp: int, tokens: float) -> float:
    """A gated DeltaNet layer's forward FLOPs for ``tokens`` on one TP rank (module docstring)."""
    dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
    heads = model.linear_num_value_heads / tp
    v = heads * dv
    c = 2 * model.linear_num_key_heads * dk / tp + v
    projections = 2 * tokens * model.hidden_size * (c + 2 * v + 2 * heads)
    conv = 2 * tokens * c * model.linear_conv_kernel_dim
    chunk = 64
    delta_rule = tokens * heads * (3 * 2 * dk * dv + 2 * 2 * chunk * (dk + dv))
    return projections + conv + delta_rule


def group_bandwidth(kind: str, layout: ParallelLayout, gpu: GPUSpec) -> float:
    """Link bandwidth (bytes/s, after efficiency) of the group a traffic kind runs on."""
    tp, cp, dp, etp, ep = layout.tp, layout.cp, layout.dp, layout.expert_tp, layout.ep
    span = {
        "tp": tp,
        "cp": tp * cp,
        "dp": tp * cp * dp,
        "ep": etp * ep,
        "etp": etp,
        "tp_ep": tp * ep,
        "dp_expert": layout.world_size // layout.pp,
        "pp": layout.world_size,
    }[kind]
    link = gpu.nvlink_bandwidth if span <= gpu.gpus_per_node else gpu.ib_bandwidth
    return link * gpu.link_efficiency


@dataclass(frozen=True)
class StepTime:
    """One optimizer step (a mini-batch of ``micro_batches`` per data-parallel rank)."""

    compute_s: float
    comm_s: dict[str, float]
    bubble_fraction: float
    total_s: float  # no communication overlapped: the band's upper end
    tokens_per_s_per_gpu: float
    lower_s: float = 0.0  # model-parallel communication fully overlapped: the band's lower end
    forward_s: float = 0.0  # one forward-only pass over the same mini-batch


def step_time(
    model: MoEModelConfig,
    layout: ParallelLayout,
    micro: MicroBatchShape,
    micro_batches: int,
    traffic_by_stage: list[Traffic],
    gpu: GPUSpec,
    recompute: bool = False,
    expert_imbalance: float = 1.0,
) -> StepTime:
    """Seconds per optimizer step (``micro_batches`` per data-parallel rank)."""
    per_stage = []
    for pp_rank in range(layout.pp):
        fwd = forward_flops(model, layout, micro, pp_rank, expert_imbalance)
        per_stage.append(fwd * (4 if recompute else 3) / (gpu.bf16_tflops * 1e12 * gpu.mfu))
    slowest = max(range(layout.pp), key=lambda r: per_stage[r])
    traffic = traffic_by_stage[slowest]
    comm = {kind: traffic.wire_bytes(kind) / group_bandwidth(kind, layout, gpu) for kind in traffic.group_size}
    per_micro_comm = sum(v for k, v in comm.items() if not k.startswith("dp")) / micro_batches
    dp_comm = sum(v for k, v in comm.items() if k.startswith("dp"))
    slots = micro_batches + bubble_slots(layout)
    total = slots * (per_stage[slowest] + per_micro_comm) + dp_comm
    lower = slots * max(per_stage[slowest], per_micro_comm) + dp_comm
    forward = slots * (per_stage[slowest] / (4 if recompute else 3) + per_micro_comm / 2)
    tokens = micro.tokens * micro_batches * layout.dp
    return StepTime(
        per_stage[slowest] * micro_batches,
        comm,
        bubble_slots(layout) / slots,
        total,
        tokens / total / layout.world_size,
        lower_s=lower,
        forward_s=forward,
    )


@dataclass(frozen=True)
class RolloutShape:
    """One RL step's generation: ``sequences`` = prompts x group size, on ``servers`` engines of ``engine_tp`` GPUs."""

    sequences: int
    prompt_tokens: int
    response_tokens: int  # rollout.max_new_tokens: every sequence decodes this many (an upper bound)
    servers: int
    engine_tp: int
    colocated: bool  # the engine shares the trainer's GPUs (phases run one after the other)


def rollout_seconds(model: MoEModelConfig, shape: RolloutShape, gpu: GPUSpec, width: int = 2) -> float:
    """Roofline lower bound of the generation phase (see the module docstring)."""
    counts = model.parameter_count()
    per_server = -(-shape.sequences // shape.servers)
    flops_rate = gpu.bf16_tflops * 1e12 * gpu.mfu * shape.engine_tp
    prefill = 2 * counts["active"] * per_server * shape.prompt_tokens / flops_rate
    moe_layers = model.num_layers - len(model.dense_layers)
    expert_params = moe_layers * model.num_experts * 3 * model.hidden_size * model.moe_intermediate_size
    # expected fraction of a layer's experts that some token of a decode step picks (uniform routing)
    touched = 1 - (1 - model.top_k / model.num_experts) ** per_server if model.is_moe else 1.0
    weights = (counts["total"] - expert_params + touched * expert_params) * width
    # K and V of the full-attention layers only; each gated DeltaNet layer reads its constant-size state
    kv_layers = model.num_layers - len(model.linear_attention_layers)
    kv_per_token = 2 * kv_layers * model.num_kv_heads * model.head_dim * width
    kv = per_server * (shape.prompt_tokens + shape.response_tokens / 2) * kv_per_token
    kv += linear_state_bytes(model, per_server, width)
    memory_bound = (weights + kv) / (gpu.hbm_bandwidth * shape.engine_tp)
    compute_bound = 2 * counts["active"] * per_server / flops_rate
    return prefill + shape.response_tokens * max(memory_bound, compute_bound)


@dataclass(frozen=True)
class RLStepTime:
    """Seconds of one RL step by phase, in the trainer's order."""

    rollout_s: float
    old_log_prob_s: float
    reference_s: float
    updates_s: float  # updates_per_rollout optimizer steps
    sync_s: float
    overlapped: bool  # async rollout on separate GPUs: generation runs beside the training phases

    @property
    def training_s(self) -> float:
        return self.old_log_prob_s + self.reference_s + self.updates_s

    @property
    def total_s(self) -> float:
        if self.overlapped:
            return max(self.rollout_s, self.training_s) + self.sync_s
        return self.rollout_s + self.training_s + self.sync_s


def rl_step_time(
    step: StepTime,
    rollout_s: float,
    sync_s: float,
    *,
    updates_per_rollout: int,
    old_log_prob_pass: bool,
    reference_model: bool,
    overlapped: bool,
    reference_in_s: float = 0.0,
) -> RLStepTime:
    """Each forward-only pass covers the whole rollout batch: ``updates_per_rollout`` mini-batches.
    ``reference_in_s``: the offloaded reference's weights brought to the device for its pass."""
    forward = step.forward_s * updates_per_rollout
    return RLStepTime(
        rollout_s,
        forward if old_log_prob_pass else 0.0,
        forward + reference_in_s if reference_model else 0.0,
        step.total_s * updates_per_rollout,
        sync_s,
        overlapped,
    )
