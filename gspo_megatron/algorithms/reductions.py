"""Parallel reductions of per-sequence quantities and of metric dicts.

Design decisions:
- Under context parallelism (CP) each rank holds a slice of every sequence's tokens, but GSPO's
  s_i = exp(sum_t log w_{i,t} / |y_i|) needs whole-sequence sums. ``context_parallel_sequence_sum``
  returns the full-sequence sum on every CP rank, while its gradient reaches only this rank's tokens:
      out = local + sg[allreduce(local) - local]
  The forward value is the full sum; d out / d local = 1. The loss built from ``out`` is the same on
  every CP rank, and each rank's gradient is exactly the part of the single-rank gradient that belongs
  to its tokens, so the per-rank gradients summed over CP ranks equal the single-rank gradient.
  This project's DDP *sums* grads over the dp x cp group (``calculate_per_token_loss=True``, see
  ``policy/models/schedule.py``), so no cp_size scaling is needed; under megatron's default averaging the
  loss would have to be scaled by cp_size, as megatron's own GPT loss does.
- The loss value is therefore replicated over CP ranks: log it from one CP rank, and reduce metric
  *sums* over data-parallel ranks only. Token-level min/max are local to a CP slice, so reduce those
  over the CP group too (``extremum_group``); min/max are idempotent, replication does not hurt them.
- Metric dicts (see ``metrics.py``) are reduced with at most three collectives: every sum/count
  stacked into one SUM all-reduce, every min into one MIN, every max into one MAX.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.metrics import reduction_of


def local_sequence_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the token dim of an already-masked ``[B, T]`` tensor (no parallelism)."""
    return x.sum(dim=-1)


def context_parallel_sequence_sum(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Full-sequence sum of ``x`` over the CP group, with gradient for this rank's tokens only.

    ``x`` is ``[B, T_local]`` (summed over valid tokens, ``mask`` true) or an already-summed ``[B]``.
    Returns ``[B]``: the same value on every CP rank. Every rank of ``cp_group`` must call it.
    """
    if x.dim() == 2:
        local = (torch.where(mask.bool(), x, 0.0) if mask is not None else x).sum(dim=-1)
    elif x.dim() == 1:
        if mask is not None:
            raise ValueError("mask applies to [B, T] inputs only; an already-summed [B] input takes none")
        local = x
    else:
        raise ValueError(f"expected [B, T] or [B], got shape {tuple(x.shape)}")
    if cp_group is None or dist.get_world_size(group=cp_group) == 1:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=cp_group)
    # value: the full-sequence sum; gradient: d/d local = 1 (this rank's tokens only).
    return local + (total - local.detach())


def context_parallel_sequence_sum_fn(cp_group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``LossContext.sequence_sum`` for a CP group (the plain local sum when ``cp_group`` is None)."""
    if cp_group is None:
        return local_sequence_sum
    return functools.partial(context_parallel_sequence_sum, mask=None, cp_group=cp_group)


def all_reduce_metrics(
    metrics: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    extremum_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Reduce a metric dict over ``group`` (sums/counts) and ``extremum_group`` (min/max; default ``group``).

    Returns a new dict; the input is not modified. Every rank must pass the same keys.
    """
    extremum_group = group if extremum_group is None else extremum_group
    keys = sorted(metrics)
    out = {key: metrics[key].detach().clone() for key in keys}
    for op_name, op, op_group in (
        ("sum", dist.ReduceOp.SUM, group),
        ("min", dist.ReduceOp.MIN, extremum_group),
        ("max", dist.ReduceOp.MAX, extremum_group),
    ):
        selected = [key for key in keys if reduction_of(key) == op_name]
        if not selected:
            continue
        stacked = torch.stack([out[key].float().reshape(()) for key in selected])
        dist.all_reduce(stacked, op=op, group=op_group)
        for key, value in zip(selected, stacked.unbind(), strict=True):
            out[key] = value
    return out
