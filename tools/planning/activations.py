"""Activation and loss-head memory of one micro-batch on one rank: what autograd keeps for backward.

Design decisions:
- Counted tensor by tensor from what each op of this project's layer stack saves (portable spec:
  ``policy/models/layers.py`` RMSNorm and SDPA attention, megatron's column/row-parallel linears with
  sequence parallelism, the allgather token dispatcher and ``SequentialMLP`` experts; the grouped
  experts of ``policy/models/grouped_experts.py`` keep no more for backward, but for bf16/fp16 on
  CPU, where each expert's rows are padded to a multiple of 32: at most 31 rows per expert more,
  not counted), in elements per token, then times the activation width. The same counts are used
  for the TE spec on GPU; TE's fused norm and flash attention save a little less (no repeated K/V
  heads), so GPU numbers err high.
- ``spec="te"`` (TransformerEngine + flash attention, the GPU default) differs only in attention:
  flash attention saves K and V unrepeated (2TK instead of 2TQ) and writes its output in the layout
  the projection reads (no TQ copy); under CP its ring attention passes K/V blocks around the ring
  and keeps only the rank's own. Only the portable spec is measured here (no GPU).
- Portable CP attention (``policy/parallel/context_parallel.py``) all-gathers K and V over the CP group
  before SDPA: what SDPA saves is the gathered length cp*T, 2 cp T Q repeated (GQA; 2 cp T K without
  GQA, K and V both gathered copies), and it keeps the bool causal mask [S/cp, S] of each layer
  (S the padded sequence length: one byte per query-key pair of a sequence, shared by the batch).
- Notation per layer: T tokens of the micro-batch on this rank (after CP), T_sp = T / tp with
  sequence parallelism, h hidden, Q = heads*d/tp, K = kv_heads*d/tp, F = moe_ffn/etp, E experts,
  k top-k, N = b T_sp * etp * k expert rows (tokens the dispatcher routes to this rank's experts;
  b = ``PlanOptions.expert_imbalance``, the rank's routed rows over the balanced share: 1 on
  average, an input of the plan since routing depends on the data and the weights; ``--calibrate``
  fits it).
- RMSNorm (fp32 math): saves its input, the normalised x and its output: 3 T_sp h (fp32 inputs).
- Attention: fused QKV output T(Q + 2K) stays alive through the q/k-norm views; q/k norms add
  normalised + output 2T(Q + K); RoPE'd queries TQ; K and V repeated to all query heads 2TQ (GQA;
  TK without GQA: the RoPE'd keys; V is a view of the QKV output); SDPA output TQ and its
  [s, b, hQ] copy TQ; log-sum-exp T*heads/tp fp32.
- Gated full attention (``model.attention_output_gate``, Qwen3-Next / Qwen3.5): the fused QKV output also
  holds the per-head gate TQ; sigmoid of the gate TQ and the gated output TQ (the projection's input).
- Gated DeltaNet linear attention (``model.linear_attention_layers``; megatron's ``ssm/gated_delta_net.py``
  forward, FLA's chunked kernel), per token with C = (2 key width + value width)/tp conv channels,
  V = value width/tp, H = value heads/tp, R = H * key head dim (q and k repeated to the value heads), KQ =
  2 key width/tp: the input norm 3 T_sp h; the fused in_proj output T(C + V + 2H); the conv's input copy
  TC, its output TC and SiLU's output TC; q/k L2 norms in and out 2 T KQ; q, k repeated 2TR; value, gate,
  beta and alpha copies T(V + V + 2H); the decay g and beta in fp32 ~4TH (counted at the activation width:
  under 1% of the layer); the kernel's output TV and its per-chunk states, one [H, dk, dv] fp32 state per 64
  tokens, T H dk dv / 64 (FLA's chunk size; the torch chunked rule keeps more: it is the CPU path); the
  gated RMSNorm's input, normalised x and output 3TV, the fp32 gate and its SiLU 2TV, the product TV and
  its transposed copy TV (the out projection's input). Nothing in the layer grows with the sequence
  beyond T: no attention matrix, no repeated K/V of the whole sequence.
- MoE: router logits, scores and top-k probabilities ~3 T_sp E fp32; experts keep the permuted
  tokens N h, fc1 output 2NF, SiLU output NF, gated product NF and the expert outputs before the
  probability weighting N h.
- Dense MLP (a dense layer, or the shared expert): input is the norm output; fc1 2TF', SiLU TF',
  product TF' with F' = ffn/tp.
- Loss head (last stage): the logits [T, V/tp] fp32 and, during backward, their gradient of the same
  size (``algorithms/logprobs.py`` writes it in place: no further full-vocabulary workspace). The
  output layer's backward then makes the gradient contiguous (GPTModel returned the logits
  transposed) while the first copy is still referenced, and allocates its weight gradient
  [V/tp, h] before DDP adds it to the grad buffer: 2 T V/tp + h V/tp at that moment.
- Full recompute (``trainer.recompute_activations``) keeps only each layer's input T_sp h and
  rebuilds one layer at a time in backward: layers * T_sp h + one layer's activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.parallel.layout import ParallelLayout

FP32 = 4


@dataclass(frozen=True)
class MicroBatchShape:
    sequences: int  # sequences per micro-batch
    seq_len: int  # padded tokens per sequence

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len


@dataclass(frozen=True)
class ActivationBytes:
    per_layer: list[int]  # saved bytes of each layer of this stage, one micro-batch
    boundary: int  # embedding output / final norm saved tensors
    loss_head: int  # logits + their gradient (last stage only)
    recompute_per_layer: int  # what one layer keeps under full recompute

    def total(self, recompute: bool = False) -> int:
        if not self.per_layer:
            return self.boundary + self.loss_head
        if recompute:
            kept = self.recompute_per_layer * len(self.per_layer) + max(self.per_layer)
            return kept + self.boundary + self.loss_head
        return sum(self.per_layer) + self.boundary + self.loss_head


def attention_elements(model: MoEModelConfig, layout: ParallelLayout, tokens: float, spec: str = "portable") -> float:
    tp = layout.tp
    sp_tokens = tokens / tp if layout.use_sequence_parallel else tokens
    q = model.num_attention_heads * model.head_dim / tp
    kv = model.num_kv_heads * model.head_dim / tp
    gqa = model.num_kv_heads != model.num_attention_heads
    norm = 3 * sp_tokens * model.hidden_size
    qkv = tokens * (q + 2 * kv)
    qk_norms = 2 * tokens * (q + kv)
    rope_q = tokens * q
    if spec not in ("portable", "te"):
        raise ValueError(f"spec must be 'portable' or 'te', got {spec!r}")
    if spec == "te":
        repeated_kv, output = 2 * tokens * kv, tokens * q
    elif layout.cp > 1:  # K and V all-gathered over the CP group: SDPA saves cp*T keys and values
        gathered = layout.cp * tokens
        repeated_kv = 2 * gathered * (q if gqa else kv)
        output = 2 * tokens * q
    else:
        repeated_kv = 2 * tokens * q if gqa else tokens * kv
        output = 2 * tokens * q
    lse = tokens * model.num_attention_heads / tp
    gate = 3 * tokens * q if model.attention_output_gate else 0.0  # its QKV rows, sigmoid, gated output
    return norm + qkv + qk_norms + rope_q + repeated_kv + output + lse + gate


FLA_CHUNK = 64  # tokens per chunk of FLA's chunk_gated_delta_rule (its per-chunk states)


def linear_attention_elements(model: MoEModelConfig, layout: ParallelLayout, tokens: float) -> float:
    """A gated DeltaNet layer's saved elements for ``tokens`` (module docstring: the formula's terms)."""
    tp = layout.tp
    sp_tokens = tokens / tp if layout.use_sequence_parallel else tokens
    key_width = model.linear_num_key_heads * model.linear_key_head_dim / tp
    v = model.linear_num_value_heads * model.linear_value_head_dim / tp
    heads = model.linear_num_value_heads / tp
    c = 2 * key_width + v
    repeated = heads * model.linear_key_head_dim
    norm = 3 * sp_tokens * model.hidden_size
    projections = tokens * (c + v + 2 * heads)
    conv = 3 * tokens * c
    l2_norms = 2 * tokens * 2 * key_width
    copies = tokens * (2 * repeated + 2 * v + 2 * heads) + 4 * tokens * heads
    states = tokens * heads * model.linear_key_head_dim * model.linear_value_head_dim / FLA_CHUNK
    gated_norm = tokens * (v + 3 * v + 2 * v + 2 * v)
    return norm + projections + conv + l2_norms + copies + states + gated_norm


def moe_elements(model: MoEModelConfig, layout: ParallelLayout, tokens: float, imbalance: float = 1.0) -> float:
    tp, etp = layout.tp, layout.expert_tp
    sp_tokens = tokens / tp if layout.use_sequence_parallel else tokens
    h = model.hidden_size
    norm = 3 * sp_tokens * h
    router = 3 * sp_tokens * model.num_experts
    rows = imbalance * sp_tokens * etp * model.top_k
    ffn = model.moe_intermediate_size / etp
    experts = rows * (2 * h + 4 * ffn)
    shared = dense_mlp_elements(model.shared_expert_intermediate_size / tp, tokens)
    return norm + router + experts + shared


def dense_mlp_elements(ffn_per_rank: float, tokens: float) -> float:
    return 4 * tokens * ffn_per_rank if ffn_per_rank else 0.0


def activation_bytes(
    model: MoEModelConfig,
    layout: ParallelLayout,
    micro: MicroBatchShape,
    pp_rank: int,
    width: int = FP32,
    spec: str = "portable",
    imbalance: float = 1.0,
) -> ActivationBytes:
    """Bytes one rank of stage ``pp_rank`` keeps for the backward of one micro-batch (``imbalance``:
    its experts' routed rows over the balanced share)."""
    from planning.parameters import stage_layers

    tokens = micro.tokens / layout.cp
    sp_tokens = tokens / layout.tp if layout.use_sequence_parallel else tokens
    h = model.hidden_size
    dense = set(model.dense_layers)
    # portable CP attention: each layer's SDPA keeps its bool causal mask [S/cp, S] (one byte a pair)
    cp_mask = micro.seq_len // layout.cp * micro.seq_len if spec == "portable" and layout.cp > 1 else 0
    per_layer = []
    linear = set(model.linear_attention_layers)
    for i in stage_layers(model, layout, pp_rank):
        if i in linear:
            attention = linear_attention_elements(model, layout, tokens)
        else:
            attention = attention_elements(model, layout, tokens, spec)
        if i in dense:
            norm = 3 * sp_tokens * h
            mlp = norm + dense_mlp_elements(model.dense_intermediate_size / layout.tp, tokens)
        else:
            mlp = moe_elements(model, layout, tokens, imbalance)
        per_layer.append(int((attention + mlp) * width) + (0 if i in linear else cp_mask))
    last = pp_rank == layout.pp - 1
    boundary = int(3 * sp_tokens * h * width) if last else 0
    vocab = model.vocab_size / layout.tp
    loss_head = int((2 * tokens * vocab + h * vocab) * FP32) if last else 0
    return ActivationBytes(per_layer, boundary, loss_head, int(sp_tokens * h * width))
