"""Portable building blocks for the megatron-core layer spec (no TransformerEngine, no CUDA).

- ``RMSNorm``: marks its weight ``sequence_parallel`` when the config uses sequence parallelism, so
  megatron's ``finalize_model_grads`` all-reduces its gradient over the TP group (each TP rank only
  sees its slice of the sequence). torch's wrapped norm refuses sequence parallelism outright. Under
  ``config.layernorm_zero_centered_gamma`` (Qwen3-Next, Qwen3.5) the weight w starts at 0 and scales by 1 + w,
  as megatron's own norms and those checkpoints do, so the conversion copies it unchanged.
- ``GatedOutputRMSNorm``: gated DeltaNet's output norm (megatron's ``GatedDeltaNet.out_norm``, over one value
  head); the checkpoints store its scale plainly, whatever the other norms do.
- ``SDPACoreAttention``: megatron's core-attention interface ([s, b, heads, dim] in, [s, b, hidden]
  out) on ``torch.nn.functional.scaled_dot_product_attention`` with a causal mask and grouped-query
  heads. Megatron's local ``DotProductAttention`` allocates from a CUDA memory buffer.
  Under context parallelism (cp > 1) each rank holds a load-balanced share of the sequence; keys and
  values are all-gathered over the CP group and the causal mask compares global positions
  (``policy/parallel/context_parallel.py``); the K/V gradients flow back to the ranks that own them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from gspo_megatron.policy.parallel.context_parallel import causal_mask_for_rank, gather_keys_values


class RMSNorm(torch.nn.Module):
    # y = x / sqrt(mean(x^2) + eps) * weight (zero-centred: * (1 + weight)), computed in fp32 like HF Qwen3RMSNorm.
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.zero_centered = self.follows_zero_centered_config and bool(config.layernorm_zero_centered_gamma)
        start = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(start(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]  # read by megatron

    follows_zero_centered_config = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (1 + self.weight if self.zero_centered else self.weight) * x.to(dtype)


class GatedOutputRMSNorm(RMSNorm):
    """Gated DeltaNet's output norm over one value head (megatron applies the gate after it). Its weight is
    whole on every TP rank while each rank normalises its own heads, so its gradient is a partial sum per
    rank: marked ``sequence_parallel`` under TP for megatron's TP all-reduce of such gradients."""

    follows_zero_centered_config = False

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = config.tensor_model_parallel_size > 1  # type: ignore[attr-defined]


class QKRMSNorm(RMSNorm):
    """RMSNorm over head_dim for queries/keys; its TP all-reduce comes from megatron's name rule
    (``q_layernorm``/``k_layernorm`` under ``config.qk_layernorm``), not from sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False  # type: ignore[attr-defined]  # read by megatron


class AllHeadsRMSNorm(torch.nn.Module):
    """OLMoE's q/k norm: one RMSNorm over all heads' width (num_heads x head_dim), not per head. Megatron hands
    it a rank's heads, ``[s, b, heads / tp, head_dim]``; the mean square is summed over the TP group (the other
    ranks hold the other heads) and each rank multiplies by its heads' part of the whole weight:
        y[h, d] = x[h, d] / sqrt(sum_{all heads h', d'} x[h', d']^2 / (heads x head_dim) + eps) * w[h, d]
    The sum's backward sums its gradient over the group too (each rank's heads depend on every rank's x).
    The weight is whole on every rank, like the per-head norms': its gradient is non-zero in the rank's
    heads only, and megatron's TP all-reduce of q/k norm gradients (``finalize_model_grads``, under
    ``config.qk_layernorm``) adds the ranks' parts into the whole gradient everywhere, so the copies stay
    equal and checkpoints and the conversion treat it as replicated."""

    heads_key = "num_attention_heads"

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.heads = getattr(config, self.heads_key)
        self.local_heads = self.heads // config.tensor_model_parallel_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(self.heads * hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = False  # type: ignore[attr-defined]  # read by megatron

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        dtype = x.dtype
        x = x.float()
        squares = x.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.local_heads != self.heads:  # forward: the sum over the group; backward: its gradient summed too
            squares = reduce_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(squares))
        x = x * torch.rsqrt(squares / self.weight.numel() + self.eps)
        first = ps.get_tensor_model_parallel_rank() * self.local_heads
        weight = self.weight.view(self.heads, -1)[first : first + self.local_heads]
        return weight * x.to(dtype)


class AllHeadsKeyRMSNorm(AllHeadsRMSNorm):
    """``AllHeadsRMSNorm`` over the key heads (num_kv_heads x head_dim)."""

    heads_key = "num_query_groups"


class SDPACoreAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        k_channels=None,  # multi-latent attention: a key's and a value's widths (SDPA takes them from
        v_channels=None,  # the tensors; MLA passes its softmax_scale)
    ):
        super().__init__(config=config)
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1:
            from megatron.core import parallel_state as ps

            self.cp_group = pg_collection.cp if pg_collection is not None else ps.get_context_parallel_group()
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences need the TE layer spec")
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        if attention_mask is not None:
            if self.cp_size > 1:
                raise NotImplementedError("the portable context-parallel attention supports causal masks only")
            mask = ~attention_mask.bool()  # megatron: True = masked out; SDPA: True = attend
        if self.cp_size > 1:
            # keys/values of the whole sequence (rank-major chunks); causal mask by global positions
            key, value = (gather_keys_values(t, self.cp_group) for t in (key, value))
            if causal:
                rank = dist.get_rank(group=self.cp_group)
                mask = causal_mask_for_rank(query.shape[0], self.cp_size, rank, device=query.device)
                causal = False
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:  # grouped-query attention: repeat each KV head for its queries
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
