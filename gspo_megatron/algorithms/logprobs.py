"""Token log-probabilities (and entropy) from vocab-parallel logits, without gathering the vocabulary.

Design decisions (compare megatron-core ``tensor_parallel/cross_entropy.py``, which this replaces for
RL, where we need log pi(y_t) itself, a temperature, and an entropy metric):
- Logits ``[..., V_local]`` are this rank's contiguous vocabulary shard; shard ``r`` of the TP group
  holds ids ``[r * V_local, (r + 1) * V_local)`` (megatron's ``VocabUtility`` layout). Targets are
  global ids. ``tp_group=None`` means no tensor parallelism.
- All math is fp32 whatever the logits' dtype; the temperature divides the logits first
  (z = logits / T), so the result is the log-prob under the *sampling* distribution.
- Each rank reduces its shard to four numbers per token: its local max ``m_r``, its log-sum-exp
  relative to it ``lse_r - m_r``, the target logit relative to it ``z_y - m_r`` (used from the rank that
  owns y), and the entropy ``h_r`` of its local softmax (entropy only). One all-gather of that
  ``[tp, N, 4]`` block then gives everything, for all chunks at once (M = max_r m_r):
      lse      = M + logsumexp_r (lse_r - M)            (exact; no second pass over the vocabulary)
      log p(y) = (z_y - m_owner) + (m_owner - M) - (lse - M)
      H        = sum_r w_r (h_r - log w_r),  w_r = exp(lse_r - lse)
  (the entropy of a mixture of disjoint supports: every term is >= 0, so unlike lse - E_p[z] there is
  no cancellation of large numbers when the distribution is peaked)
  That is one collective per call (megatron does three), and nothing of size V crosses ranks.
- Memory: the forward saves only the logits it was given (a reference, no copy) and the per-token
  ``lse`` [N]; it never keeps a softmax. The backward recomputes p = exp(z - lse) chunk by chunk and
  writes d log p(y) / d logits = (onehot(y) - p) / T, scaled by the incoming gradient, straight into
  the gradient buffer (for fp32 logits the gradient buffer *is* the workspace: no temporary at all).
  ``chunk_size`` (tokens along the flattened leading dims) bounds the fp32 workspace of both passes
  to ``chunk_size x V_local``; ``None`` means one chunk. One workspace is reused across chunks, and
  every step is an in-place op on it: fresh large allocations cost page faults that outweigh the exp.
  Measured with ``tools/bench_loss_head.py`` (4096 x 32k, CPU): peak = the gradient alone for fp32.
- Entropy is returned detached (a metric) unless ``entropy_grad=True`` (an entropy bonus). Then the
  backward adds d H / dz_j = -p_j (log p_j + H) times the entropy's incoming gradient g_H, in the same
  chunked pass as the log-prob gradient g:
      d/d logits_j = (1/T) [ g 1[j = y] - p_j (g + g_H (log p_j + H)) ]
  H and lse are global over the TP group, so each rank writes its own shard's exact gradient. That
  path needs one extra fp32 chunk (p beside log p); the plain path is unchanged.
- Targets outside ``[0, V_local * tp)`` (e.g. an ignore index of -100 at padding) get log-prob 0 and
  zero gradient instead of garbage, so padded positions can never leak NaNs into a masked loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

_STATS = 4  # per token and rank: local max, local lse - max, target logit - max, local entropy


@overload
def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = ...,
    temperature: float = ...,
    chunk_size: int | None = ...,
    with_entropy: Literal[True],
    entropy_grad: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = ...,
    temperature: float = ...,
    chunk_size: int | None = ...,
    with_entropy: Literal[False] = ...,
    entropy_grad: bool = ...,
) -> tuple[torch.Tensor, None]: ...


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` under softmax(logits / temperature) over the TP-sharded vocabulary.

    Args:
        logits: ``[..., V_local]`` this rank's vocabulary shard (any float dtype).
        targets: ``[...]`` global token ids (int64), same leading shape as ``logits``.
        tp_group: the tensor-parallel group the vocabulary is split over; None for no TP.
        temperature: divides the logits before the softmax (> 0).
        chunk_size: tokens per chunk for the fp32 temporaries; None processes all tokens at once.
        with_entropy: also return the per-token entropy (fp32; detached unless ``entropy_grad``).
        entropy_grad: let gradients flow through the entropy (for an entropy bonus in the loss).

    Returns ``(log_probs [...] fp32, entropy [...] fp32 or None)``. Every rank of the TP group gets the
    same values and must call this collectively.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: logits must be "
            f"targets.shape + (V_local,)"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if entropy_grad and not with_entropy:
        raise ValueError("entropy_grad=True needs with_entropy=True")
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits, targets, tp_group, float(temperature), chunk_size, with_entropy, entropy_grad
    )
    return log_probs, (entropy if with_entropy else None)


def _shard_info(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _chunks(num_tokens: int, chunk_size: int | None) -> Iterator[slice]:
    step = num_tokens if chunk_size is None else chunk_size
    for start in range(0, num_tokens, max(step, 1)):
        yield slice(start, min(start + step, num_tokens))


def _shifted_into(workspace: torch.Tensor, logits_chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """workspace <- (logits - max) / T in fp32, in place; returns the local max of z = logits / T."""
    workspace.copy_(logits_chunk)  # the only read of the logits; casts to fp32
    local_max = workspace.amax(dim=-1, keepdim=True)
    workspace.sub_(local_max)  # <= 0, exact near the max
    if temperature != 1.0:
        workspace.mul_(1.0 / temperature)
        local_max = local_max / temperature  # T > 0 keeps the argmax
    return local_max.squeeze(-1)


def _local_stats(shifted: torch.Tensor, local_targets: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
    """Per-token [lse_r - m_r, z_y - m_r, h_r or 0] of one chunk, from ``shifted`` = z - m_r.

    Everything is kept relative to the local max m_r (as log_softmax does), so the small numbers that
    matter -- log p of a confident token, the entropy of a peaked distribution -- are never rounded
    at the scale of the logits themselves. ``shifted`` is consumed (overwritten); ``scratch`` (same
    shape) is needed only for the entropy.
    """
    stats = shifted.new_zeros(shifted.shape[0], _STATS - 1)
    stats[:, 1] = shifted.gather(-1, local_targets.clamp(0, shifted.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    if scratch is None:
        stats[:, 0] = shifted.exp_().sum(-1).log()
        return stats
    exp_shifted = torch.exp(shifted, out=scratch)
    sum_exp = exp_shifted.sum(-1)
    stats[:, 0] = sum_exp.log()
    # h_r = -sum_j p_j (s_j - log S) = log S - E_p[s]: two non-negative terms, no cancellation.
    stats[:, 2] = stats[:, 0] - exp_shifted.mul_(shifted).sum(-1) / sum_exp
    return stats


def _combine_stats(
    all_stats: torch.Tensor, flat_targets: torch.Tensor, vocab_local: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[tp, N, 4] per-rank stats -> (lse [N], log p(y) [N], entropy [N]); see the module docstring."""
    global_max = all_stats[..., 0].amax(dim=0)  # M
    rel_lse = all_stats[..., 0] - global_max + all_stats[..., 1]  # lse_r - M
    log_norm = torch.logsumexp(rel_lse, dim=0)  # lse - M
    owner = (flat_targets // vocab_local).clamp(0, all_stats.shape[0] - 1).unsqueeze(0)
    owner_stats = all_stats.gather(0, owner.unsqueeze(-1).expand(1, -1, all_stats.shape[-1])).squeeze(0)
    # log p(y) = z_y - lse = (z_y - m_owner) + (m_owner - M) - (lse - M)
    log_probs = owner_stats[:, 2] + (owner_stats[:, 0] - global_max) - log_norm
    log_weights = rel_lse - log_norm  # log share of the partition function held by each rank
    entropy = (log_weights.exp() * (all_stats[..., 3] - log_weights)).sum(0)
    return global_max + log_norm, log_probs, entropy


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        temperature: float,
        chunk_size: int | None,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rank, world = _shard_info(tp_group)
        vocab_local = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab_local)
        flat_targets = targets.reshape(-1).long()
        local_targets = flat_targets - rank * vocab_local
        owned = (local_targets >= 0) & (local_targets < vocab_local)
        valid = (flat_targets >= 0) & (flat_targets < vocab_local * world)

        num_tokens = flat_targets.shape[0]
        stats = flat_logits.new_empty(num_tokens, _STATS, dtype=torch.float32)
        # One fp32 workspace reused by every chunk: fresh multi-MiB allocations cost page faults that
        # take longer than the exp itself on CPU.
        rows_per_chunk = max(min(chunk_size or num_tokens, num_tokens), 1)
        workspace = flat_logits.new_empty(rows_per_chunk, vocab_local, dtype=torch.float32)
        scratch = torch.empty_like(workspace) if with_entropy else None
        for rows in _chunks(num_tokens, chunk_size):
            n = rows.stop - rows.start
            stats[rows, 0] = _shifted_into(workspace[:n], flat_logits[rows], temperature)
            stats[rows, 1:] = _local_stats(workspace[:n], local_targets[rows], None if scratch is None else scratch[:n])
        del workspace, scratch
        if world > 1:
            gathered = [torch.empty_like(stats) for _ in range(world)]
            dist.all_gather(gathered, stats, group=tp_group)
            all_stats = torch.stack(gathered)
        else:
            all_stats = stats.unsqueeze(0)
        lse, log_probs, entropy = _combine_stats(all_stats, flat_targets, vocab_local)

        log_probs = torch.where(valid, log_probs, 0.0).view(targets.shape)
        ctx.save_for_backward(logits, local_targets, owned, valid, lse, entropy.detach().clone())
        entropy = entropy.view(targets.shape)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        # grad_entropy is None unless entropy_grad=True and the entropy reached the loss.
        no_grads = (None,) * 6
        if grad_log_probs is None and grad_entropy is None:
            return (None,) + no_grads
        logits, local_targets, owned, valid, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        vocab_local = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab_local)
        num_tokens = flat_logits.shape[0]
        if grad_log_probs is None:
            grad_log_probs = flat_logits.new_zeros(num_tokens, dtype=torch.float32)
        # d log p(y) / d logits_j = (1[j = y] - p_j) / T, times the incoming gradient g.
        scale = torch.where(valid, grad_log_probs.reshape(-1).float(), 0.0) / temperature
        grad_logits = torch.empty_like(flat_logits)
        # fp32 logits: the gradient buffer itself is the workspace; otherwise one fp32 chunk is reused.
        rows_per_chunk = max(min(ctx.chunk_size or num_tokens, num_tokens), 1)
        workspace = None
        if logits.dtype != torch.float32:
            workspace = flat_logits.new_empty(rows_per_chunk, vocab_local, dtype=torch.float32)
        # The entropy gradient's inputs, when the entropy reached the loss: g_H per token and a buffer
        # for p beside log p.
        entropy_terms = None
        if grad_entropy is not None:
            probs_buffer = flat_logits.new_empty(rows_per_chunk, vocab_local, dtype=torch.float32)
            entropy_terms = (grad_entropy.reshape(-1).float(), probs_buffer)
        for rows in _chunks(num_tokens, ctx.chunk_size):
            n = rows.stop - rows.start
            grad = grad_logits[rows] if workspace is None else workspace[:n]
            grad.copy_(flat_logits[rows])
            grad.sub_((lse[rows] * temperature).unsqueeze(-1))  # x - T lse
            if temperature != 1.0:
                grad.mul_(1.0 / temperature)  # log p = x / T - lse
            if entropy_terms is None:
                grad.exp_()  # p
                grad.mul_(-scale[rows].unsqueeze(-1))  # -g p / T
            else:
                entropy_scale, probs = entropy_terms
                p = torch.exp(grad, out=probs[:n])
                grad.add_(entropy[rows].unsqueeze(-1))
                grad.mul_(entropy_scale[rows].unsqueeze(-1))  # g_H (log p + H)
                grad.add_(scale[rows].unsqueeze(-1) * temperature)  # + g
                grad.mul_(p).mul_(-1.0 / temperature)  # -p (g + g_H (log p + H)) / T
            row_ids = torch.arange(n, device=grad.device)
            target_cols = local_targets[rows].clamp(0, vocab_local - 1)
            grad.index_put_((row_ids, target_cols), torch.where(owned[rows], scale[rows], 0.0), accumulate=True)
            if workspace is not None:
                grad_logits[rows].copy_(grad)
        return (grad_logits.view(logits.shape),) + no_grads
