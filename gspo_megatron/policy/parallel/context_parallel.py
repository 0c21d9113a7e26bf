"""Context parallelism (CP) without TransformerEngine: the sequence split, its inverse, the K/V gather.

Design decisions:
- megatron-core's load-balanced split (``megatron.core.utils.get_batch_on_this_cp_rank``): the
  sequence is cut into 2*CP equal chunks and CP rank r holds chunks r and 2*CP-1-r, so every rank
  has the same causal-attention work. Global positions held by rank r (chunk length c = S/(2*CP)):
      [r*c, (r+1)*c) ++ [(2*CP-1-r)*c, (2*CP-r)*c)
  megatron's RotaryEmbedding applies the same split to the rotary table itself, so no position ids
  need to travel with the tokens.
- The trainer right-pads each rollout batch to a length divisible by 2*CP
  (``pad_for_context_parallel``); ONE place splits a micro-batch (``split_micro_batch``): every
  tensor whose dim 1 is the token dim
  (tokens, targets, masks, log-probs, routed experts [b, s, layers, k]) is split alike; per-row
  tensors ([b]) and non-tensors pass through. ``gather_sequence`` is its inverse (all-gather over
  the CP group, then put the chunks back in sequence order).
- Attention: ``gather_keys_values`` all-gathers K/V over the CP group (at this scale a gather is
  simpler than a ring). Its backward sums every rank's K/V gradient and returns each rank the part
  that belongs to its own tokens: all-reduce + slice (gloo has no reduce-scatter on CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from gspo_megatron.policy.parallel.layout import LayoutError


class PerTokenBatch(Protocol):
    """What the split needs of a batch (``contracts/micro_batch.py:MicroBatch`` is one)."""

    def map_per_token(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PerTokenBatch: ...


BatchT = TypeVar("BatchT", bound=PerTokenBatch)


def validate_context_parallel(cp_size: int, max_position_embeddings: int) -> None:
    """Start-up check: padded rows (length a multiple of 2*CP) must stay within the model's positions."""
    if cp_size > 1 and max_position_embeddings % (2 * cp_size):
        raise LayoutError(
            f"parallel.cp={cp_size} splits every sequence into 2*cp = {2 * cp_size} chunks, so rows are padded "
            f"to a multiple of {2 * cp_size}; model.max_position_embeddings={max_position_embeddings} is not "
            f"one: set it to a multiple of {2 * cp_size} "
            f"(e.g. {max_position_embeddings // (2 * cp_size) * 2 * cp_size})"
        )


def chunk_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global token positions [S / CP] held by ``cp_rank``, in the order the rank holds them."""
    if cp_size == 1:  # no split: any length
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp_size}; pad the batch to a "
            "multiple of 2*parallel.cp (the trainer does: pad_for_context_parallel)"
        )
    c = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, second])


def split_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's load-balanced share of ``x`` along ``seq_dim``."""
    if cp_size == 1:
        return x
    index = chunk_positions(x.shape[seq_dim], cp_size, cp_rank, device=x.device)
    return x.index_select(seq_dim, index).contiguous()


def pad_for_context_parallel(batch, cp_size: int):
    """A ``RolloutBatch`` whose model-input length S-1 is right-padded to a multiple of 2*CP."""
    return pad_sequence_length(batch, 2 * cp_size if cp_size > 1 else 1)


def pad_sequence_length(batch, multiple: int):
    """A ``RolloutBatch`` whose model-input length S-1 is right-padded to a multiple of ``multiple``
    (2*CP for the load-balanced CP split; times TP under sequence parallelism, whose reduce-scatter
    splits the sequence over TP ranks: ``contracts/token_budget.py:sequence_multiple``).

    Padding goes at the end of every row with zero masks (token id 0, log-probs 0): under causal attention
    no real token attends to it, so real tokens' outputs are unchanged. Its routed experts are 0..k-1, a
    valid top-k as ``rollout/pack.py`` pads them: megatron-core 0.19.2's alltoall dispatcher counts a token's
    expert slots, not its distinct experts, and failed on zeros (R3 under cp2: "split_sizes to sum exactly to
    48 ... got [22, 4, 10, 8]").
    """
    inputs = batch.tokens.shape[1] - 1
    pad = -inputs % multiple
    if pad == 0:
        return batch
    values = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] in (inputs, inputs + 1):
            shape = (value.shape[0], pad, *value.shape[2:])
            filler = value.new_zeros(shape)
            if f.name == "routed_experts":  # [b, s, layers, k]: k distinct experts
                filler = torch.arange(shape[-1], dtype=value.dtype).expand(shape).clone()
            value = torch.cat([value, filler], dim=1)
        values[f.name] = value
    return dataclasses.replace(batch, **values)


def split_micro_batch(batch: BatchT, cp_size: int, cp_rank: int) -> BatchT:
    """Split every per-token tensor of a schedule micro-batch (dim 1 = the token dim of ``tokens``)."""
    if cp_size == 1:
        return batch
    return batch.map_per_token(lambda value: split_sequence(value, cp_size, cp_rank))  # type: ignore[return-value]


def gather_sequence(local: torch.Tensor, cp_group: dist.ProcessGroup | None, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of ``split_sequence``: every rank's share -> the whole sequence, on every CP rank."""
    cp_size = 1 if cp_group is None else dist.get_world_size(group=cp_group)
    if cp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=cp_group)
    gathered = torch.cat(parts, dim=seq_dim)
    seq_len = gathered.shape[seq_dim]
    positions = torch.cat([chunk_positions(seq_len, cp_size, r, device=local.device) for r in range(cp_size)])
    order = torch.argsort(positions)  # gathered[..., j] holds global position positions[j]
    return gathered.index_select(seq_dim, order)


class _GatherKeysValues(torch.autograd.Function):
    """[s_local, ...] on each rank -> [cp * s_local, ...] (rank-major); backward: sum, keep own part."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, cp_group) -> torch.Tensor:
        ctx.cp_group = cp_group
        ctx.rank = dist.get_rank(group=cp_group)
        ctx.length = local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group=cp_group))]
        dist.all_gather(parts, local.contiguous(), group=cp_group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # d loss / d K_r = sum over every rank's queries that attended to K_r
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.cp_group)
        return grad[ctx.rank * ctx.length : (ctx.rank + 1) * ctx.length], None


def gather_keys_values(local: torch.Tensor, cp_group) -> torch.Tensor:
    """All-gather a sequence-first tensor over the CP group (rank-major order), gradient to owners."""
    return _GatherKeysValues.apply(local, cp_group)


def causal_mask_for_rank(local_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Bool [s_local, cp * s_local]: True where this rank's query may attend the gathered key.

    Query i sits at global position q_pos[i]; gathered key j (rank-major) at k_pos[j];
    causal attention allows k_pos <= q_pos.
    """
    seq_len = local_len * cp_size
    q_pos = chunk_positions(seq_len, cp_size, cp_rank, device=device)
    k_pos = torch.cat([chunk_positions(seq_len, cp_size, r, device=device) for r in range(cp_size)])
    return k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
