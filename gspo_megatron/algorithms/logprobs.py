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
  the gradient buffer. ``chunk_size`` (tokens along the flattened leading dims) bounds the fp32
  temporaries of both passes to ``chunk_size x V_local``; ``None`` means one chunk.
- Entropy is a metric: it is returned detached (no gradient flows through it). An entropy bonus would
  need d H / dz = -p (log p + H), which this Function does not implement.
- Targets outside ``[0, V_local * tp)`` (e.g. an ignore index of -100 at padding) get log-prob 0 and
  zero gradient instead of garbage, so padded positions can never leak NaNs into a masked loss.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_STATS = 4  # per token and rank: local max, local lse - max, target logit - max, local entropy


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of ``targets`` under softmax(logits / temperature) over the TP-sharded vocabulary.

    Args:
        logits: ``[..., V_local]`` this rank's vocabulary shard (any float dtype).
        targets: ``[...]`` global token ids (int64), same leading shape as ``logits``.
        tp_group: the tensor-parallel group the vocabulary is split over; None for no TP.
        temperature: divides the logits before the softmax (> 0).
        chunk_size: tokens per chunk for the fp32 temporaries; None processes all tokens at once.
        with_entropy: also return the per-token entropy (detached, fp32).

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
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits, targets, tp_group, float(temperature), chunk_size, with_entropy
    )
    return log_probs, (entropy if with_entropy else None)


def _shard_info(tp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _chunks(num_tokens: int, chunk_size: Optional[int]):
    step = num_tokens if chunk_size is None else chunk_size
    for start in range(0, num_tokens, max(step, 1)):
        yield slice(start, min(start + step, num_tokens))


def _scaled_fp32(logits_chunk: torch.Tensor, temperature: float, *, writable: bool) -> torch.Tensor:
    """z = logits / T in fp32; a fresh buffer when ``writable`` (the caller's logits are never touched)."""
    if logits_chunk.dtype != torch.float32:
        z = logits_chunk.float()  # the cast already makes a fresh buffer
    elif temperature != 1.0:
        return torch.div(logits_chunk, temperature)  # fresh, in one pass
    elif writable:
        z = logits_chunk.clone()
    else:
        return logits_chunk  # read-only use of fp32 logits at T = 1: no copy at all
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _local_stats(z: torch.Tensor, local_targets: torch.Tensor, with_entropy: bool) -> torch.Tensor:
    """Per-token [m_r, lse_r - m_r, z_y - m_r, h_r] for one chunk of this shard.

    Everything is kept relative to the local max m_r (as log_softmax does), so the small numbers that
    matter -- log p of a confident token, the entropy of a peaked distribution -- are never rounded
    at the scale of the logits themselves.
    """
    stats = z.new_zeros(z.shape[0], _STATS)
    local_max = z.amax(dim=-1, keepdim=True)
    shifted = z - local_max  # <= 0, exact near the max
    stats[:, 0] = local_max.squeeze(-1)
    stats[:, 2] = shifted.gather(-1, local_targets.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    if with_entropy:
        exp_shifted = shifted.exp()
        sum_exp = exp_shifted.sum(-1, keepdim=True)
        stats[:, 1] = sum_exp.log().squeeze(-1)
        log_p_local = shifted.sub_(stats[:, 1:2])
        stats[:, 3] = -(exp_shifted.div_(sum_exp).mul_(log_p_local)).sum(-1)  # h_r = -sum p_r log p_r
    else:
        stats[:, 1] = shifted.exp_().sum(-1).log()
    return stats


def _combine_stats(all_stats: torch.Tensor, flat_targets: torch.Tensor, vocab_local: int):
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
    def forward(ctx, logits, targets, tp_group, temperature, chunk_size, with_entropy):
        rank, world = _shard_info(tp_group)
        vocab_local = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab_local)
        flat_targets = targets.reshape(-1).long()
        local_targets = flat_targets - rank * vocab_local
        owned = (local_targets >= 0) & (local_targets < vocab_local)
        valid = (flat_targets >= 0) & (flat_targets < vocab_local * world)

        stats = flat_logits.new_empty(flat_targets.shape[0], _STATS, dtype=torch.float32)
        for rows in _chunks(flat_targets.shape[0], chunk_size):
            z = _scaled_fp32(flat_logits[rows], temperature, writable=False)
            stats[rows] = _local_stats(z, local_targets[rows], with_entropy)
            del z
        if world > 1:
            gathered = [torch.empty_like(stats) for _ in range(world)]
            dist.all_gather(gathered, stats, group=tp_group)
            all_stats = torch.stack(gathered)
        else:
            all_stats = stats.unsqueeze(0)
        lse, log_probs, entropy = _combine_stats(all_stats, flat_targets, vocab_local)

        log_probs = torch.where(valid, log_probs, 0.0).view(targets.shape)
        entropy = entropy.view(targets.shape)
        ctx.save_for_backward(logits, local_targets, owned, valid, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy):
        # _grad_entropy is ignored: entropy is a detached metric (see the module docstring).
        if grad_log_probs is None:
            return None, None, None, None, None, None
        logits, local_targets, owned, valid, lse = ctx.saved_tensors
        temperature = ctx.temperature
        vocab_local = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab_local)
        # d log p(y) / d logits_j = (1[j = y] - p_j) / T, times the incoming gradient g.
        scale = torch.where(valid, grad_log_probs.reshape(-1).float(), 0.0) / temperature
        num_tokens = scale.shape[0]
        single_chunk = ctx.chunk_size is None or ctx.chunk_size >= num_tokens
        grad_logits = None if single_chunk and logits.dtype == torch.float32 else torch.empty_like(flat_logits)
        for rows in _chunks(num_tokens, ctx.chunk_size):
            grad = _scaled_fp32(flat_logits[rows], temperature, writable=True)
            grad.sub_(lse[rows].unsqueeze(-1)).exp_()  # p
            grad.mul_(-scale[rows].unsqueeze(-1))  # -g p / T
            row_ids = torch.arange(rows.start, rows.stop, device=grad.device) - rows.start
            target_cols = local_targets[rows].clamp(0, vocab_local - 1)
            grad.index_put_((row_ids, target_cols), torch.where(owned[rows], scale[rows], 0.0), accumulate=True)
            if grad_logits is None:
                grad_logits = grad
            else:
                grad_logits[rows].copy_(grad)
            del grad
        if grad_logits is None:  # no tokens at all
            grad_logits = torch.zeros_like(flat_logits)
        return grad_logits.view(logits.shape), None, None, None, None, None
