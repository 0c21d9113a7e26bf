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
- The overlapped step (``overlapped_step_s``): with the data at most k >= 1 versions behind, rollout and
  training on disjoint GPUs cost max(gen, train) + sync per step instead of gen + train + sync; a long tail
  (rounds of unequal length) is absorbed only over k rounds. ``split_prediction`` compares a colocated step
  with the same GPUs split into training and rollout GPUs, each side scaled linearly with its GPUs.
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
        return overlapped_step_s([self.rollout_s], self.training_s, self.sync_s, 1 if self.overlapped else 0)


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


def overlapped_step_s(round_s: list[float], training_s: float, sync_s: float, max_staleness: int) -> float:
    """Mean step time when generation and training run on disjoint GPUs, the data at most ``max_staleness``
    (k) versions behind; ``round_s``: the generation time of successive rounds (one step's batch each),
    repeating -- one value for a constant round, several for a long tail (most rounds short, some long).

    k = 0 (synchronous):  step = mean(round) + train + sync (the two sides take turns)
    k >= 1:               step = mean over windows w of k consecutive rounds of max(mean_w(round), train) + sync

    With k >= 1 the engine generates round s + 1 while the trainer trains step s, so a constant round costs
    max(gen, train) + sync (full overlap in steady state: k = 1 suffices). A round longer than training
    stalls the trainer unless earlier short rounds banked it: the buffer holds at most k rounds, so the
    trainer sees the k-round mean (an approximation of the bounded queue: exact for k = 1 and for k at or
    above the pattern's length, where it is max(mean(round), train) + sync). The sync stalls both sides:
    weights land between rounds (``rollout/streaming.py``)."""
    if not round_s or min(round_s) < 0 or max_staleness < 0:
        raise ValueError(f"round_s {round_s} must be non-empty and >= 0, max_staleness {max_staleness} >= 0")
    mean_round = sum(round_s) / len(round_s)
    if max_staleness == 0:
        return mean_round + training_s + sync_s
    window = min(max_staleness, len(round_s))
    repeated = round_s + round_s[: window - 1]  # the pattern repeats: windows wrap around
    means = [sum(repeated[i : i + window]) / window for i in range(len(round_s))]
    return sum(max(m, training_s) for m in means) / len(means) + sync_s


@dataclass(frozen=True)
class SplitPrediction:
    """A colocated RL step against the same GPUs split into training and rollout GPUs, generation overlapped."""

    gpus: int
    rollout_gpus: int
    colocated_s: float  # rollout + training + sync on all GPUs, taking turns
    rollout_s: float  # one round on rollout_gpus, waiting for its longest response
    filled_rollout_s: float  # the same tokens with the tail's freed slots filled by the next round's requests
    training_s: float  # old log-probs + reference + updates on the rest
    sync_s: float

    def split_s(self, max_staleness: int) -> float:
        """k = 0: the two sides take turns; k = 1: overlapped, each round waits for its longest response;
        k >= 2: overlapped, the next round's requests fill the slots the tail frees (continuous generation)."""
        rollout = self.filled_rollout_s if max_staleness >= 2 else self.rollout_s
        return overlapped_step_s([rollout], self.training_s, self.sync_s, max_staleness)

    def speedup(self, max_staleness: int) -> float:
        return self.colocated_s / self.split_s(max_staleness)


def split_prediction(
    colocated: RLStepTime, gpus: int, rollout_gpus: int, mean_response_frac: float = 1.0
) -> SplitPrediction:
    """Assumes both sides scale linearly with their GPUs (an upper bound on either side's speed on fewer
    GPUs; whether the trainer fits on gpus - rollout_gpus is not checked here), and a long tail of
    response lengths, mean / longest = ``mean_response_frac`` (1: every response as long as the longest,
    the roofline's assumption):

        rollout_split = rollout_colocated x gpus / rollout_gpus            (a round waits for its longest)
        filled_rollout_split = rollout_split x mean_response_frac         (k >= 2: slots never idle)
        training_split = training_colocated x gpus / (gpus - rollout_gpus)
        step_split(k) = overlapped_step_s([rollout], training_split, sync, k)

    Under linear scaling and no tail the split never beats colocation (max(g N / R, t N / (N - R)) >= g + t,
    equal at the balanced R): what overlap buys comes from the tail (and from decode's better use of fewer
    GPUs at larger batches, not modelled)."""
    if not 0 < rollout_gpus < gpus:
        raise ValueError(f"rollout GPUs {rollout_gpus}: give 1 .. {gpus - 1} of the {gpus} GPUs (--rollout-gpus)")
    if not 0 < mean_response_frac <= 1:
        raise ValueError(f"mean_response_frac {mean_response_frac}: mean / longest response, in (0, 1]")
    rollout_s = colocated.rollout_s * gpus / rollout_gpus
    training_s = colocated.training_s * gpus / (gpus - rollout_gpus)
    colocated_s = colocated.rollout_s + colocated.training_s + colocated.sync_s
    return SplitPrediction(
        gpus, rollout_gpus, colocated_s, rollout_s, rollout_s * mean_response_frac, training_s, colocated.sync_s
    )
