"""All local experts of an MoE layer in one grouped computation, without TransformerEngine.

For expert e with its routed rows X_e (megatron's dispatchers hand the rows sorted by local expert,
``tokens_per_expert`` rows each) and their routing probabilities p_e:

    [G_e | U_e] = X_e W1_e^T              W1_e = linear_fc1.weight of expert e (gate rows, then up rows)
    Y_e = (silu(G_e) * U_e * p_e) W2_e^T  W2_e = linear_fc2.weight of expert e

which is megatron's ``MLP.forward`` for an expert (SwiGLU, probabilities applied after the
activation) run on every expert's rows at once.

Design decisions:
- A subclass of megatron's ``SequentialMLP`` that only replaces ``forward``: the parameters are
  SequentialMLP's own ``local_experts.{i}.linear_fc1/linear_fc2`` (column/row-parallel expert linears),
  so DDP's expert buffers, the expert-parallel ``sharded_state_dict`` of dist checkpoints and the HF
  conversion (``policy/models/conversion.py``) are the same for both; the router, the dispatcher and routing
  replay never see the difference. With expert tensor parallelism each rank holds its shard of W1
  (gate and up rows) and of W2, and the dispatcher's reduce-scatter sums the partial outputs, as for
  SequentialMLP (its linears run with ``explicit_expert_comm``: no collectives of their own).
- Kernel: ``torch._grouped_mm`` (one call per projection over all experts, row offsets from the
  token counts); its CPU kernel multiplies group by group in C++ (bit-exact with one GEMM per expert
  in our tests), without SequentialMLP's Python loop through megatron's linear layers. Where it
  cannot run -- rows whose byte strides are not multiples of 16 (hidden or FFN width not a multiple
  of 16 bytes), CUDA without bf16 on compute capability >= 9.0, or bias, fp8/fp4, clamped or offset
  activations that this file does not implement -- the layer falls back to SequentialMLP's forward.
- One storage per projection: at construction the experts' ``linear_fc1.weight`` (and, apart,
  ``linear_fc2.weight``) become views of one [E, out, in] tensor, in expert order (the same
  Parameters, values and names; only where their data lives changes). The grouped GEMMs then take
  that tensor as a view, with no copy. Whatever moves the weights elsewhere (megatron's DDP buffer of
  the distributed optimizer, which lays parameters out in reverse order) is detected at each call and
  the layer stacks the weights into [E, out, in] for the duration of one grouped GEMM instead.
  The copy it saves is the largest non-GEMM item of the layer: at the medium shape (16 experts,
  hidden 256, FFN 128) 6 MiB per layer, forward and again backward.
- Padded expert groups on CPU for bf16/fp16: there the per-group GEMMs go to oneDNN, which compiles
  (JITs) a kernel for every new GEMM shape and keeps a bounded cache of them. Routed row counts
  change every micro-batch, so nearly every expert GEMM was a new shape: in the medium benchmark's
  bf16 update the expert GEMMs ran at 9-50 GFLOP/s against 200-500 for repeated shapes
  (torch.profiler, ``tools/bench_rl_step.py --torch-profile``). Each expert's rows are therefore
  padded with zero rows to a multiple of ``CPU_ROW_MULTIPLE`` (once before fc1, removed once after
  fc2: zero rows give zero outputs and zero weight gradients, so results are unchanged), and the
  shapes repeat. fp32 goes to MKL's sgemm (no per-shape compilation) and CUDA to its own grouped
  GEMM: neither pads. The padding costs at most ``CPU_ROW_MULTIPLE - 1`` rows per expert of
  activation memory, forward and backward.
- Memory: ``GroupedLinear`` saves for backward the rows and the parameters themselves, so what
  autograd keeps per layer is no more than SequentialMLP keeps (``tests/distributed/
  test_grouped_experts.py`` counts the saved bytes); plain autograd through ``torch.stack`` would keep a
  copy of the layer's local expert weights per micro-batch in flight (Qwen3-30B-A3B, EP=8, bf16:
  151 MB per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

_STRIDE_BYTES = 16  # torch._grouped_mm: every stride of its operands a multiple of 16 bytes
CPU_ROW_MULTIPLE = 32  # bf16/fp16 on CPU: each expert's rows padded to a multiple of this (see above)


def grouped_mm_fits(hidden_size: int, fc1_width: int, ffn_width: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` takes the expert GEMMs of these widths on this device."""
    size = torch.empty((), dtype=dtype).element_size()
    if any(width * size % _STRIDE_BYTES for width in (hidden_size, fc1_width, ffn_width)):
        return False
    if device.type == "cuda":  # torch's CUDA grouped GEMM: bf16 on Hopper and newer
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


def share_one_storage(weights: list[torch.Tensor]) -> None:
    """Make the parameters ``weights`` (each [out, in], one per expert) views of one [E, out, in]
    tensor in expert order, keeping their values and the Parameter objects."""
    if len(weights) < 2 or weights[0].device.type == "meta":
        return
    stacked = torch.stack([weight.detach() for weight in weights])
    for weight, view in zip(weights, stacked, strict=True):
        weight.data = view


def stacked_weights(weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[E, out, in]: a view of the one storage the weights share, when they still lie there back to
    back in expert order (``share_one_storage``); otherwise a copy (``torch.stack``)."""
    first = weights[0]
    storage, step = first.untyped_storage().data_ptr(), first.numel()
    in_place = all(
        weight.is_contiguous()
        and weight.untyped_storage().data_ptr() == storage
        and weight.storage_offset() == first.storage_offset() + index * step
        for index, weight in enumerate(weights)
    )
    if in_place:
        return first.as_strided((len(weights), *first.shape), (step, *first.stride()))
    return torch.stack(weights)


def group_row_multiple(dtype: torch.dtype, device: torch.device) -> int:
    """Rows per expert group are padded to a multiple of this: ``CPU_ROW_MULTIPLE`` for bf16/fp16 on
    CPU (oneDNN's per-shape kernels), 1 (no padding) otherwise."""
    return CPU_ROW_MULTIPLE if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else 1


def padded_positions(counts: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's rows (``counts`` [E], rows sorted by expert) moved to groups padded to a multiple of
    ``multiple`` rows: (position of every row in the padded layout [N], padded counts [E]).

        padded_e = ceil(n_e / m) m;   row i of expert e: i + (sum_{j<e} padded_j - sum_{j<e} n_j)
    """
    counts = counts.to(torch.int64)
    padded = (counts + multiple - 1) // multiple * multiple
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)
    positions = torch.arange(int(counts.sum()), device=counts.device) + shift.repeat_interleave(counts)
    return positions, padded


class GroupedLinear(torch.autograd.Function):
    """rows [N, in], int32 end offsets [E] of each expert's rows, weights W_e [out, in] -> [N, out]:

        forward:   Y_e = X_e W_e^T
        backward:  dX_e = dY_e W_e,   dW_e = dY_e^T X_e

    each a single ``torch._grouped_mm`` over all experts (the weight gradients as one [E, out, in]
    result, unbound per expert; the weights as one [E, out, in] tensor, ``stacked_weights``)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, offsets: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, offsets, *weights)
        return torch._grouped_mm(rows, stacked_weights(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, offsets, *weights = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_rows = None
        if ctx.needs_input_grad[0]:
            grad_rows = torch._grouped_mm(grad_out, stacked_weights(weights), offs=offsets)
        grad_weights: tuple[torch.Tensor | None, ...] = (None,) * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grad_weights = torch._grouped_mm(grad_out.t(), rows, offs=offsets).unbind(0)
        return (grad_rows, None, *grad_weights)


class GroupedExperts(SequentialMLP):
    """megatron's expert-MLP interface: ``forward(rows [N, h], tokens_per_expert [E], probs [N])``
    -> (output [N, h], None)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for linear in ("linear_fc1", "linear_fc2"):
            share_one_storage([getattr(expert, linear).weight for expert in self.local_experts])

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        if not self._grouped_supported(permuted_local_hidden_states):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        rows = permuted_local_hidden_states
        probs = permuted_probs
        if self.config.moe_apply_probs_on_input:  # megatron: top-1 only, probabilities scale the input
            rows = (probs.unsqueeze(-1) * rows).to(rows.dtype)
            probs = torch.ones_like(probs)
        counts = torch.as_tensor(tokens_per_expert, device=rows.device)
        positions = None
        multiple = group_row_multiple(rows.dtype, rows.device)
        if multiple > 1:
            positions, counts = padded_positions(counts, multiple)
            total = int(counts.sum())
            rows = rows.new_zeros(total, rows.shape[-1]).index_copy(0, positions, rows)
            probs = probs.new_zeros(total).index_copy(0, positions, probs)
        offsets = counts.cumsum(0).to(torch.int32)  # int32 end offsets of each expert's rows
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]  # each [2F, h]: gate rows, up rows
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]  # each [h, F]
        gate, up = GroupedLinear.apply(rows, offsets, *fc1).chunk(2, dim=-1)
        hidden = self.config.activation_func(gate) * up
        hidden = (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
        output = GroupedLinear.apply(hidden, offsets, *fc2)
        return (output if positions is None else output.index_select(0, positions)), None

    def _grouped_supported(self, rows: torch.Tensor) -> bool:
        config = self.config
        expert = self.local_experts[0]
        fc1_width, hidden_size = expert.linear_fc1.weight.shape
        plain_swiglu = (
            config.gated_linear_unit
            and config.activation_func is F.silu
            and not config.add_bias_linear
            and config.activation_func_clamp_value is None
            and config.glu_linear_offset == 0.0
            and not (config.fp8 or config.fp4)
        )
        return plain_swiglu and grouped_mm_fits(hidden_size, fc1_width, fc1_width // 2, rows.dtype, rows.device)
