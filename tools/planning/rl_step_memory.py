"""Per-rank peak memory of the whole RL step: what is resident for the run, plus the largest phase.

Design decisions:
- peak = resident + held across phases + max over phases of what that phase adds. Phases are the
  trainer's (``loop/trainer.py:train_step``, ``_phase``): rollout, old_logp, ref_logp, update,
  weight_sync. Every term below is a count of the tensors the code allocates, with its source; no
  constant is fitted to a measurement (checked on gloo ranks within 10% of the CPU allocator's
  running total: tests/distributed/test_planner_rl_step_memory.py).
- Resident: the rank's model state (``parameters.state_bytes``, exact), the frozen reference's
  weights when ``algorithm.kl.coef > 0``, and on the driver (global rank 0) the embedded engine's own
  transformers model of the family: every HF tensor once (``policy/models/hf_shapes.py``) in ``rollout.embedded.dtype``.
  SGLang's engines live in their own processes and GPUs: nothing on the trainer's ranks. Under
  sequence parallelism (tp > 1) megatron gathers a column-parallel linear's input into its global
  memory buffer ("mpu", ``megatron/core/tensor_parallel/layers.py``), allocated at the first forward
  and kept for the run: the largest gathered input, [T, h] of a micro-batch (T its tokens over cp).
- Held across phases (``contracts/batch.py``): the rank's rows of the ``RolloutBatch`` -- tokens int64
  [n, s+1], four fp32 [n, s] (response and input masks, rollout and old log-probs), three fp32 and
  four int64 per row -- and its micro-batches cut from them (``micro_batch``: indexing copies):
  tokens and targets int64 [n, s], the same four fp32 [n, s] (+ reference log-probs under KL), one
  fp32 advantage and one int64 row id per row; R3's replayed experts (``planner.memory_of_stage``).
  s is the fed length (``job.py``).
- Rollout, embedded engine on the driver (``rollout/embedded/engine.py``, transformers 5.x Qwen3-MoE with
  its ``grouped_mm`` experts, SDPA): the prefill of one chunk of R = min(rows, max_batch_size) rows
  left-padded to P prompt tokens is the largest moment. It feeds each distinct prompt once
  (``_prefill_once_per_prompt``): U prompts, the most a chunk of the prompt-major rows spans with a group size g
  (R / g where chunks start at groups' first rows), T = U P. Live at the last layer's experts:
  the model's input embeddings T h (its forward keeps ``inputs_embeds``), rotary cos and sin 2 T d,
  the KV cache of every layer 2 L T K (K = kv_heads d), the layer's input, the residual after
  attention and the normed input 3 T h; routing: logits and fp32 probabilities T E (w + 4), top-k
  weights and indices T k (4 + 8), the sort of the expert ids T k (4 + 8); the experts: the permuted
  tokens T k h, fc1 T k 2F, SiLU of the gate half T k F and the gated product T k F. A dense last
  layer instead: gate, up, SiLU and product 4 T F'. Decoding adds one token per row per step: the
  cache at the end, 2 L R (P + N) K, and the sampled logits R V (w + 2 * 4: fp32 softmax and its
  log) -- the larger of the two moments counts. R3 keeps the captured experts int32 [R, P+N, L, k].
  A hybrid stack (Qwen3-Next, Qwen3.5: ``model.linear_attention_layers``) caches K and V on its
  full-attention layers only (L above counts those); each gated DeltaNet layer instead carries a state of
  constant size per row, whatever the length (transformers' ``LinearAttentionCacheLayerMixin``): the conv
  state [conv channels, kernel] in the engine dtype and the delta rule's [value heads, key dim, value dim]
  counted in fp32 (FLA's and the torch rule's accumulation width; an upper bound for a bf16 engine),
  held from the prefill on (``linear_state_bytes``).
  The driver also holds the whole batch before it is scattered (its per-row bytes above, N rows).
- Old log-probs / reference log-probs: forward-only under ``torch.no_grad`` (one layer's tensors and
  the logits at a time: ``planner.memory_of_stage``'s forward-only pass); with
  ``trainer.reference_offload`` the reference's weights are resident only in its phase
  (``MemoryRow.reference_pass``).
- Update: the training activations of the micro-batches in flight and the loss head (``activations.py``);
  on a stage before the last, each in-flight micro-batch's output [T_sp, h] (megatron keeps it for
  the backward: ``deallocate_pipeline_outputs=False``, ``policy/models/builder.py``) and the output
  gradient received for the backward, [T_sp, h].
- Colocated SGLang (``rollout.placement=colocated``): in the rollout and the weight sync the engine holds
  its ``--mem-fraction-static`` share of the GPU and the trainer's gradient buffers are freed
  (``loop/colocation.py``); in the other phases the engine holds nothing (its memory saver).
- Weight sync (``loop/weight_sync.py``): SGLang -- the driver (with per-stage senders, each stage's
  first rank too) holds the bucket being filled plus the tensor being gathered
  (``comm.weight_sync_plan``); the embedded engine loads each tensor as it arrives, so a sender holds
  the tensor being gathered and its HF-named conversion: 2 x the largest HF tensor in the model dtype.
  The other ranks join the gathers with the same bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.models.hf_shapes import hf_shapes
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.policy.routing.replay_strategy import needs_engine_routing
from planning.parameters import DTYPE_BYTES
from planning.pipeline import in_flight_factor

if TYPE_CHECKING:
    from planning.planner import MemoryRow, PlanOptions

FP32 = 4
INT64 = 8
INT32 = 4
ENGINE_DTYPE_BYTES = {**DTYPE_BYTES, "float16": 2}  # rollout.embedded.dtype
PHASES = ("rollout", "old_logp", "ref_logp", "update", "weight_sync")


@dataclass(frozen=True)
class EmbeddedEngineShape:
    """The in-process engine (``rollout.engine=embedded``): its dtype and rows per generation chunk."""

    dtype: str = "float32"  # rollout.embedded.dtype
    max_batch_size: int = 256  # rollout.embedded.max_batch_size
    # rollout.embedded.forward=lean where it serves the model (rollout/embedded/lean_forward.py: Qwen3-MoE)
    lean: bool = False


@dataclass(frozen=True)
class RLStepMemory:
    """One rank's bytes over the RL step: resident + held across phases + the largest phase."""

    resident: int  # model state + reference weights + (driver, embedded engine) the engine's weights
    across_phases: int  # rollout batch rows, micro-batches, replayed routes
    phases: dict[str, int]  # what each phase adds on top (PHASES)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    def phase_total(self, name: str) -> int:
        """Bytes at the phase's peak. The rollout makes the batch: what is held across phases does
        not exist yet while it runs (its term counts the batch it makes)."""
        return self.resident + (0 if name == "rollout" else self.across_phases) + self.phases[name]

    @property
    def peak(self) -> int:
        return self.phase_total(self.peak_phase)


def batch_bytes_per_row(fed_tokens: int, *, reference: bool) -> int:
    """Bytes one row costs a rank between rollout and weight sync: its ``RolloutBatch`` row and its
    micro-batch row (see the module docstring; s = ``fed_tokens``)."""
    s = fed_tokens
    batch_row = INT64 * (s + 1) + 4 * FP32 * s + 3 * FP32 + 4 * INT64
    micro_row = 2 * INT64 * s + (4 + int(reference)) * FP32 * s + FP32 + INT64
    return batch_row + micro_row


def engine_weight_bytes(model: MoEModelConfig, engine: EmbeddedEngineShape) -> int:
    """The embedded engine's transformers model (the family's class): every HF tensor once (tied head: once)."""
    return sum(math.prod(shape) for shape in hf_shapes(model).values()) * ENGINE_DTYPE_BYTES[engine.dtype]


def full_attention_layers(model: MoEModelConfig) -> int:
    """Layers whose KV cache grows with the sequence: all but the gated DeltaNet ones."""
    return model.num_layers - len(model.linear_attention_layers)


def linear_state_bytes(model: MoEModelConfig, rows: int, width: int) -> int:
    """The gated DeltaNet layers' recurrent state for ``rows`` sequences: constant in their length (module
    docstring): per layer and row, conv channels x kernel at ``width`` + value heads x dk x dv in fp32."""
    key_width = model.linear_num_key_heads * model.linear_key_head_dim
    conv_channels = 2 * key_width + model.linear_num_value_heads * model.linear_value_head_dim
    conv = conv_channels * model.linear_conv_kernel_dim * width
    delta = model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim * FP32
    return len(model.linear_attention_layers) * rows * (conv + delta)


def generation_bytes(
    model: MoEModelConfig,
    engine: EmbeddedEngineShape,
    rows: int,
    prompt_tokens: int,
    new_tokens: int,
    *,
    routed_experts: bool = False,
    samples_per_prompt: int = 1,
) -> int:
    """The embedded engine's largest moment in ``generate`` (module docstring: prefill vs decode);
    ``samples_per_prompt``: the group size g, rows that repeat one prompt (its prefill feeds it once)."""
    w = ENGINE_DTYPE_BYTES[engine.dtype]
    r = min(rows, engine.max_batch_size)
    g = samples_per_prompt
    # the most distinct prompts a chunk [start, end) of the prompt-major rows holds
    prompts = max((min(start + r, rows) - 1) // g - start // g + 1 for start in range(0, rows, r))
    t = prompts * prompt_tokens
    h, d, layers = model.hidden_size, model.head_dim, model.num_layers
    kv, kv_layers = model.num_kv_heads * d, full_attention_layers(model)
    state = linear_state_bytes(model, r, w)
    held = t * h * w + 2 * t * d * w + 2 * kv_layers * t * kv * w + state + t * h * w
    last = layers - 1
    if model.is_moe and last not in set(model.dense_layers):
        k, f, e = model.top_k, model.moe_intermediate_size, model.num_experts
        routing = t * e * (w + FP32) + 2 * t * k * (FP32 + INT64)
        # the lean forward's grouped_experts frees each [T k, .] intermediate as the next exists and scales in
        # place; transformers' expert loop holds its rows, gate/up, the product and the output at once
        lean_peak, loop_peak = max(h + 2 * f, 3 * f, f + h, 2 * h), h + 2 * f + f + f
        experts = t * k * (lean_peak if engine.lean else loop_peak) * w
        layer = 2 * t * h * w + routing + experts
    else:
        layer = 2 * t * h * w + 4 * t * model.dense_intermediate_size * w  # as parameters.py: a dense layer's ffn
    prefill = held + layer
    cache = 2 * kv_layers * r * (prompt_tokens + new_tokens) * kv * w + state
    decode = cache + r * model.vocab_size * (w + 2 * FP32)
    capture = r * (prompt_tokens + new_tokens) * layers * model.top_k * INT32 if routed_experts else 0
    return max(prefill, decode) + capture


def sync_sender_bytes(model: MoEModelConfig, dtype: str) -> int:
    """Embedded engine: the tensor being gathered and its HF-named copy, 2 x the largest HF tensor."""
    return 2 * max(math.prod(shape) for shape in hf_shapes(model).values()) * DTYPE_BYTES[dtype]


def sequence_parallel_buffer_bytes(model: MoEModelConfig, layout: ParallelLayout, options: PlanOptions) -> int:
    """Megatron's "mpu" all-gather buffer under sequence parallelism: [T, h] in the model dtype."""
    if not layout.use_sequence_parallel:
        return 0
    return int(options.micro.tokens / layout.cp) * model.hidden_size * DTYPE_BYTES[options.dtype]


def held_rows(layout: ParallelLayout, sequences: int) -> int:
    """Rows a rank holds from rollout to sync: its data-parallel share of every update's rows."""
    return sequences // layout.dp


def pipeline_output_bytes(
    model: MoEModelConfig, layout: ParallelLayout, options: PlanOptions, pp_rank: int, micro_batches: int
) -> int:
    """A stage before the last: its in-flight micro-batches' outputs and one received gradient."""
    if pp_rank == layout.pp - 1:
        return 0
    tokens = options.micro.tokens / layout.cp
    sp_tokens = tokens / layout.tp if layout.use_sequence_parallel else tokens
    in_flight = min(layout.pp - pp_rank, micro_batches) * in_flight_factor(layout)
    return int((in_flight + 1) * sp_tokens * model.hidden_size * DTYPE_BYTES[options.dtype])


def rl_step_memory(
    model: MoEModelConfig,
    layout: ParallelLayout,
    options: PlanOptions,
    row: MemoryRow,
    *,
    driver: bool,
    pp_rank: int = 0,
    micro_batches: int = 1,
    colocated_engine: int = 0,
) -> RLStepMemory:
    """One rank's RL step from its stage's ``MemoryRow`` (``planner.memory_of_stage``): the driver is
    global rank 0 (stage 0), where the embedded engine lives and the rollout batch is made.
    ``colocated_engine``: bytes a colocated SGLang server holds on each GPU while resumed (rollout and
    weight sync, ``loop/colocation.py``), when the trainer's gradient buffers are freed."""
    engine = options.embedded_engine
    shape = options.rollout
    sequences = shape.sequences if shape is not None else options.global_batch_tokens // options.seq_len
    per_row = batch_bytes_per_row(options.seq_len, reference=options.reference_model)
    across = held_rows(layout, sequences) * per_row + row.routing_replay
    resident = row.resident + sequence_parallel_buffer_bytes(model, layout, options)
    resident += engine_weight_bytes(model, engine) if driver and engine is not None else 0
    rollout = across  # a rank receives its rows
    if driver:
        rollout = sequences * per_row  # the whole batch, before it is scattered
        if engine is not None and shape is not None:
            generation = generation_bytes(
                model,
                engine,
                shape.sequences,
                shape.prompt_tokens,
                shape.response_tokens,
                routed_experts=needs_engine_routing(options.routing_replay),
                samples_per_prompt=options.group_size,
            )
            rollout = max(rollout, generation)
    forward_only = row.old_log_prob_pass
    if engine is not None:
        sync = sync_sender_bytes(model, options.dtype)
    else:  # SGLang: a sender (the driver; each stage's first rank with per-stage senders) fills buckets,
        # the others only join the gathers
        largest = max(math.prod(dims) for dims in hf_shapes(model).values()) * DTYPE_BYTES[options.dtype]
        sender = driver or (options.sync_senders == "per_stage" and layout.pp > 1)
        sync = options.sync_bucket_bytes + largest if sender else 2 * largest
    phases = {
        "rollout": rollout,
        "old_logp": forward_only if options.old_log_prob_pass else 0,
        "ref_logp": row.reference_pass if options.reference_model else 0,
        "update": row.activations
        + row.loss_head
        + pipeline_output_bytes(model, layout, options, pp_rank, micro_batches),
        "weight_sync": sync,
    }
    if colocated_engine:  # the engine resumed, the gradient buffers freed (the phases may be negative)
        for name in ("rollout", "weight_sync"):
            phases[name] += colocated_engine - row.state.gradients
    return RLStepMemory(resident, across, phases)
