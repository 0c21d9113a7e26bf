"""Portable building blocks for the megatron-core layer spec (no TransformerEngine, no CUDA).

- ``RMSNorm``: marks its weight ``sequence_parallel`` when the config uses sequence parallelism, so
  megatron's ``finalize_model_grads`` all-reduces its gradient over the TP group (each TP rank only
  sees its slice of the sequence). torch's wrapped norm refuses sequence parallelism outright.
- ``SDPACoreAttention``: megatron's core-attention interface ([s, b, heads, dim] in, [s, b, hidden]
  out) on ``torch.nn.functional.scaled_dot_product_attention`` with a causal mask and grouped-query
  heads. Megatron's local ``DotProductAttention`` allocates from a CUDA memory buffer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class RMSNorm(torch.nn.Module):
    # y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 like HF Qwen3RMSNorm.
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class QKRMSNorm(RMSNorm):
    """RMSNorm over head_dim for queries/keys; its TP all-reduce comes from megatron's name rule
    (``q_layernorm``/``k_layernorm`` under ``config.qk_layernorm``), not from sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, hidden_size, eps)
        setattr(self.weight, "sequence_parallel", False)


class SDPACoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError(
                "context parallelism needs TransformerEngine attention (TE layer spec); the portable "
                "spec supports cp=1 only"
            )
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences need the TE layer spec")
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:  # grouped-query attention: repeat each KV head for its queries
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask.bool()  # megatron: True = masked out; SDPA: True = attend
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale,
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
