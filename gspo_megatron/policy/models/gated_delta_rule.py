"""The gated delta rule (gated DeltaNet's linear attention) in torch, chunked: what flash-linear-attention's
Triton kernels compute, for machines without them (the CPU bridge in ``policy/cpu_bridges.py`` hands these
functions to megatron-core's ``ssm/gated_delta_net.py`` in place of FLA's).

The rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025), per head, with the state
S_t of shape [K, V], decay g_t <= 0 (log space), write strength beta_t in (0, 1):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = scale * S_t^T q_t

``recurrent_gated_delta_rule`` is this, one token at a time: the definition the tests hold the chunked
form to. ``chunk_gated_delta_rule`` computes the same in chunks of C tokens (the WY form): inside a chunk,
with G_i = g_1 + ... + g_i (cumulative log decay from the chunk's start) and S_0 the state before it,

    S_i = exp(G_i) S_0 + sum_{j <= i} exp(G_i - G_j) k_j u_j^T
    u_i = beta_i (v_i - exp(G_i) S_0^T k_i) - sum_{j < i} beta_i exp(G_i - G_j) (k_i . k_j) u_j

so (I + A) U = B V - B exp(G) K S_0 with A strictly lower triangular, A_ij = beta_i exp(G_i - G_j) k_i . k_j:
two unit-triangular solves per chunk give U without the token loop, and

    o_i = scale * (exp(G_i) S_0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) u_j)
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T                     (the next chunk's S_0)

Design decisions:
- FLA's signature and layout (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``: q, k, v as
  [batch, time, heads, dim], g and beta as [batch, time, heads], ``scale`` default K^-0.5, the final
  state [batch, heads, K, V] in fp32), so megatron's call site runs unchanged. FLA's variable-length
  ``cu_seqlens`` is refused by name: megatron 0.16 refuses packed sequences before it gets here.
- Computed in fp32 (float64 when the inputs are float64, for the tests), returned in the inputs' dtype,
  as FLA does. Differentiable through torch's autograd (``torch.linalg.solve_triangular`` has a backward),
  so the trainer's backward pass needs nothing more.
- Only exp of non-positive numbers is taken: G_i - G_j for j <= i and the masked upper triangle is set to
  -inf before exp, so long chunks with strong decay cannot overflow.
- ``l2norm`` is FLA's ``fla.modules.l2norm.l2norm``: x / sqrt(sum x^2 + eps) over the last dim.
- ``causal_conv1d`` is FLA's ``fla.modules.convolution.causal_conv1d`` (megatron-core 0.19's gated DeltaNet
  calls it; 0.16 falls back to ``nn.Conv1d`` itself): a depthwise convolution over time that sees no future
  token, x [batch, time, dim] -> the same, with FLA's optional SiLU; returns (y, None) as FLA does without
  ``output_final_state``. Its ``initial_state`` / ``cu_seqlens`` (decoding, packed sequences) are refused by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 64  # FLA's and transformers' chunk


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FLA's l2norm: x * rsqrt(sum(x^2) + eps) over the last dim, computed in fp32 (or x's wider dtype)."""
    wide = x.to(_compute_dtype(x))
    out = wide * torch.rsqrt((wide * wide).sum(dim=-1, keepdim=True) + eps)
    return out.to(output_dtype or x.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """y[:, t, d] = act(bias_d + sum_{i < W} weight[d, i] x[:, t - W + 1 + i, d]) (x = 0 before the start)."""
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise NotImplementedError(
            "causal_conv1d on CPU: initial_state / output_final_state / cu_seqlens (decoding and packed "
            "sequences) are not implemented; the trainer feeds whole padded rows"
        )
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation {activation!r} is not FLA's (None, 'silu', 'swish')")
    dim, width = weight.shape
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=dim)[..., : x.shape[1]]
    if activation is not None:
        y = F.silu(y)
    return y.transpose(1, 2), None


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rule one token at a time (the module docstring's first formula); same arguments as
    ``chunk_gated_delta_rule``."""
    dtype = q.dtype
    q, k, v, g, beta, scale, state = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    outputs = []
    for t in range(q.shape[2]):
        k_t, v_t, beta_t = k[:, :, t], v[:, :, t], beta[:, :, t, None]
        state = state * g[:, :, t, None, None].exp()
        remembered = torch.einsum("bhkv,bhk->bhv", state, k_t)  # S^T k: what the state recalls for k_t
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, beta_t * (v_t - remembered))
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    out = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return _finish(out, state, output_final_state, dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's ``chunk_gated_delta_rule`` in torch: (o [batch, time, heads, V] in q's dtype, the final state
    [batch, heads, K, V] in fp32 when ``output_final_state``, else None)."""
    if cu_seqlens is not None:
        raise NotImplementedError(
            "chunk_gated_delta_rule(cu_seqlens=...): variable-length (packed) sequences are not supported by the "
            "torch gated delta rule (megatron-core 0.16 refuses packed sequences in GatedDeltaNet before this)"
        )
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule(head_first=True): pass [batch, time, heads, dim] tensors")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    dtype = q.dtype
    q, k, v, g, beta, scale, state = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    length = q.shape[2]
    pad = (-length) % chunk_size  # zero keys, values and decays past the end change nothing before it
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // chunk_size
    q, k, v = (x.unflatten(2, (chunks, chunk_size)) for x in (q, k, v))  # [b, h, n, C, d]
    g, beta = (x.unflatten(2, (chunks, chunk_size)) for x in (g, beta))  # [b, h, n, C]

    cumulative = g.cumsum(dim=-1)  # G_i inside each chunk
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)  # j > i
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(later, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # I + A after the unit diagonal replaces this diagonal
    new_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(
        system, k_beta * cumulative.exp()[..., None], upper=False, unitriangular=True
    )  # u = new_values - state_keys @ S_0
    within = (q @ k.transpose(-1, -2)) * decay  # (q_i . k_j) exp(G_i - G_j), j <= i
    q_decayed = q * cumulative.exp()[..., None]
    k_to_end = k * (cumulative[..., -1:] - cumulative).exp()[..., None]  # exp(G_C - G_j) k_j
    chunk_decay = cumulative[..., -1].exp()[..., None, None]

    outputs = []
    for n in range(chunks):
        u = new_values[:, :, n] - state_keys[:, :, n] @ state
        outputs.append(scale * (q_decayed[:, :, n] @ state + within[:, :, n] @ u))
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :length]
    return _finish(out, state, output_final_state, dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel):
    """Heads first ([b, h, t, d]) in the compute dtype; the default scale K^-0.5; the initial state or zeros."""
    if not (q.shape == k.shape and q.shape[:3] == v.shape[:3] and g.shape == beta.shape == q.shape[:3]):
        raise ValueError(
            f"gated delta rule: q {tuple(q.shape)} and k {tuple(k.shape)} must be [batch, time, heads, K], v "
            f"{tuple(v.shape)} [batch, time, heads, V], g {tuple(g.shape)} and beta {tuple(beta.shape)} "
            "[batch, time, heads] (repeat the key heads for grouped value heads first, as megatron does)"
        )
    dtype = _compute_dtype(q)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q, output_dtype=dtype), l2norm(k, output_dtype=dtype)
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    g, beta = (x.to(dtype).transpose(1, 2) for x in (g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, heads, _, key_dim = k.shape
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    return q, k, v, g, beta, scale, state


def _finish(out, state, output_final_state, dtype):
    """Back to [b, t, h, V] in the inputs' dtype; the final state in fp32 (float64 kept), as FLA returns it."""
    out = out.transpose(1, 2).contiguous().to(dtype)
    final = None
    if output_final_state:
        final = state if state.dtype == torch.float64 else state.to(torch.float32)
    return out, final
