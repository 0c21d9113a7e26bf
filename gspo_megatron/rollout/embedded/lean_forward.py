"""The embedded engine's lean forward of a Qwen3-MoE model: transformers' math without transformers' per-call
machinery, over the same parameters, with a KV cache that grows in place.

Profile that motivated it (issue 65; ``tools/bench_vs_trl.py --shape medium``, the engine's ``generate`` under
torch.profiler, 32 rows x 64 tokens, 1 thread): matrix products 40% (the expert GEMMs 30%), ``aten::cat`` 21%
(``DynamicLayer.update`` concatenates every layer's keys and values at every token, so a row of n tokens copies
O(n^2)), attention 11%, the expert block's ``histc`` / sort / index 8%, the causal mask's ``where`` 7%, and Python
around them (module calls, output capturing, mask building).

Design decisions:
- The same math as transformers' ``Qwen3MoeForCausalLM.forward`` with ``logits_to_keep=1``, written out: RMSNorm
  (``F.rms_norm``), q/k/v projections with the per-head q/k norms, rotary embedding from the model's own
  ``rotary_emb``, SDPA with grouped KV heads, the router softmax -> top-k (-> renormalised when
  ``norm_topk_prob``), the experts, the residuals, the final norm and ``lm_head`` on the last position. Checked
  against transformers' forward to float tolerance with equal routed experts
  (``tests/unit/rollout/embedded/test_lean_forward.py``); only summation orders differ.
- Experts: tokens sorted by expert (a stable argsort), one ``torch._grouped_mm`` per projection over all experts
  with row offsets from ``bincount`` (transformers' grouped path counts with a float ``histc``, 6% of the decode
  on its own), each row scaled by its routing weight and summed back over its top-k slots. Where an operand's
  rows are not a multiple of 16 bytes (the kernel's stride rule) a loop over the experts that got rows does the same
  products.
- The attention mask is built once per forward, shared by every layer: a query sees the real keys at or before
  its position, and always itself, so a left-padding position never has a fully masked row (SDPA would give NaN
  there, and NaN values would leak through a zero weight into later positions).
- The KV cache (``growing_cache``) is transformers' ``DynamicCache`` whose layers write into preallocated room
  (``GrowingKVLayer``: doubled when full), so the engine's cache helpers (``kv_cache.py``: ``keep_cache_rows``, a
  session's kept cache) work on it unchanged; a cache transformers built (a resumed session) works here too.
- Routing: the top-k indices of each MoE layer are returned (``router_capture.py``'s ``RouterCapture.record``), the same
  indices transformers' router returns to its hook.
- Which models: ``lean_forward_for`` builds it for a Qwen3-MoE with SDPA attention, no sliding window, SiLU
  experts without biases; any other model (the other families, ``attn_implementation=eager``) keeps transformers'
  forward. Its rules are named in ``LeanForwardRefusal`` so a caller can say why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from gspo_megatron.rollout.config import LEAN_FORWARD_MODEL_TYPE

_GROUPED_MM_STRIDE_BYTES = 16  # torch._grouped_mm: every row of its operands a multiple of 16 bytes
_FIRST_ROOM = 64  # positions a fresh layer reserves beyond its first update


class GrowingKVLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values [B, kv_heads, n, head_dim] are views of preallocated room:
    ``update`` writes the new positions in place instead of concatenating. ``capacity``: the positions the call
    will feed (its prompt width + its longest budget), reserved at the first update, so a generation holds one
    room of exactly that size (the planner's KV model, ``tools/planning``); past it (a session's later turns)
    the room doubles."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self._key_room: torch.Tensor | None = None
        self._value_room: torch.Tensor | None = None
        self._length = 0
        self._capacity = capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        if self._key_room is None or self._value_room is None or end > self._key_room.shape[-2]:
            self._grow(key_states, value_states, end)
        assert self._key_room is not None and self._value_room is not None
        self._key_room[:, :, start:end] = key_states
        self._value_room[:, :, start:end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._key_room is not None and self._value_room is not None:
            self._key_room, self._value_room = self._key_room[indices], self._value_room[indices]
            self._set_length(self._length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        room = self._capacity if needed <= self._capacity else max(2 * needed, needed + _FIRST_ROOM)
        keys = key_states.new_empty(*key_states.shape[:2], room, key_states.shape[-1])
        values = value_states.new_empty(*value_states.shape[:2], room, value_states.shape[-1])
        if self._length and self._key_room is not None and self._value_room is not None:
            keys[:, :, : self._length] = self._key_room[:, :, : self._length]
            values[:, :, : self._length] = self._value_room[:, :, : self._length]
        self._key_room, self._value_room = keys, values

    def _set_length(self, length: int) -> None:
        assert self._key_room is not None and self._value_room is not None
        self._length = length
        self.keys, self.values = self._key_room[:, :, :length], self._value_room[:, :, :length]


def growing_cache(config, capacity: int = 0) -> DynamicCache:
    """A ``DynamicCache`` of ``GrowingKVLayer`` s, one per layer of ``config`` (attention layers only: the lean
    forward serves no linear-attention family), each reserving ``capacity`` positions."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingKVLayer(capacity) for _ in cache.layers]
    return cache


@dataclass(frozen=True)
class LeanForwardRefusal:
    """Why a model keeps transformers' forward (``lean_forward_for``)."""

    reason: str


@dataclass(frozen=True)
class LeanOutput:
    logits: torch.Tensor  # [B, 1, V]: the last position's
    routed: dict[int, torch.Tensor]  # MoE layer -> top-k expert indices [B * S, k]


def lean_forward_for(model: PreTrainedModel) -> Qwen3MoeLeanForward | LeanForwardRefusal:
    """The lean forward of ``model``, or why it keeps transformers' forward."""
    config = model.config
    if config.model_type != LEAN_FORWARD_MODEL_TYPE:
        return LeanForwardRefusal(f"model_type {config.model_type}: the lean forward is Qwen3-MoE's")
    if config._attn_implementation != "sdpa":
        return LeanForwardRefusal(f"attn_implementation={config._attn_implementation}: the lean forward uses SDPA")
    if getattr(config, "sliding_window", None) is not None:
        return LeanForwardRefusal("a sliding-window attention: the lean forward has full causal attention")
    if getattr(config, "attention_bias", False) or config.hidden_act != "silu":
        return LeanForwardRefusal("attention biases or a non-SiLU activation: the lean forward has neither")
    return Qwen3MoeLeanForward(model)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] (x = [x1, x2] by halves)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_mask(mask: torch.Tensor, queries: int) -> torch.Tensor:
    """bool [B, 1, queries, K] from the real-position mask [B, K] (1 real) whose last ``queries`` positions are fed
    now: a query sees the real keys at or before it, and always itself."""
    keys = mask.shape[-1]
    key_index = torch.arange(keys, device=mask.device)
    query_index = key_index[keys - queries :, None]
    allowed = (key_index <= query_index) & mask.bool()[:, None, None, :]
    return allowed | (key_index == query_index)


def grouped_experts(experts, rows: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
    """sum_j w_tj * down_e(silu(gate_e(x_t)) * up_e(x_t)) over each token t's top-k experts e = top_index[t, j]:
    rows [T, H], top_index / top_weight [T, k] -> [T, H]. ``experts``: transformers' Qwen3MoeExperts
    (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    tokens, top_k = top_index.shape
    flat = top_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=experts.num_experts)
    # each intermediate [T k, .] is released as soon as the next exists and the products are scaled in place:
    # the prefill's peak stays within the planner's expert term, T k (H + 4 I) (tools/planning/rl_step_memory.py)
    # index_select / index_copy_ rather than advanced indexing: the same copies, 4x / 1.3x faster on CPU at the
    # main job's prefill (7680 tokens x 4 slots: 1.5 -> 0.35 ms and 1.9 -> 1.2-1.6 ms a layer, CPU time, 1 thread)
    gate_up = _expert_products(rows.index_select(0, order // top_k), experts.gate_up_proj, counts)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = experts.act_fn(gate).mul_(up)
    del gate_up, gate, up
    down = _expert_products(hidden, experts.down_proj, counts)
    del hidden
    down.mul_(top_weight.reshape(-1).index_select(0, order)[:, None])
    slots = torch.empty_like(down).index_copy_(0, order, down)  # back to (token, slot) order
    del down
    return slots.view(tokens, top_k, -1).sum(dim=1)


def store_transposed(weights: torch.Tensor) -> None:
    """Lay the expert weights [E, out, in] out as [E, in, out] in memory, keeping the Parameter, its shape and its
    values: ``weights.transpose(1, 2)``, the operand of the grouped GEMMs, is then contiguous. At decode each expert
    gets a few rows and its weights come from L3 or memory at every step; there the contiguous [in, out] operand
    made the expert GEMMs of the medium shape's decode 3.4 ms a step against 5.0 (4 layers, 16 experts, hidden 256,
    FFN 128, 8 rows an expert, 1 thread). The weight loader copies into ``.data`` (strides kept)."""
    weights.data = weights.data.transpose(1, 2).contiguous().transpose(1, 2)


def _expert_products(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [S, in] sorted by expert (``counts`` [E] of each) times each expert's weights [E, out, in]^T."""
    stride_ok = all((width * rows.element_size()) % _GROUPED_MM_STRIDE_BYTES == 0 for width in weights.shape[1:])
    if stride_ok:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(rows, weights.transpose(1, 2), offs=offsets)
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            out[start : start + count] = rows[start : start + count] @ weights[expert].T
            start += count
    return out


class Qwen3MoeLeanForward:
    """``__call__(ids, mask, positions, cache)``: transformers' ``Qwen3MoeForCausalLM`` forward with
    ``logits_to_keep=1`` over ``model``'s own parameters (module docstring)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
        for index in self.moe_layers:
            experts = model.model.layers[index].mlp.experts
            for weights in (experts.gate_up_proj, experts.down_proj):
                store_transposed(weights)

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache | None
    ) -> LeanOutput:
        inner = self.model.model
        hidden = inner.embed_tokens(ids)
        cos, sin = (part.unsqueeze(1) for part in inner.rotary_emb(hidden, positions))
        allowed = attention_mask(mask, ids.shape[1])
        routed: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(inner.layers[: self.model.config.num_hidden_layers]):
            hidden = hidden + self._attention(
                layer, index, _norm(layer.input_layernorm, hidden), cos, sin, allowed, cache
            )
            normed = _norm(layer.post_attention_layernorm, hidden)
            if index in self.moe_layers:
                out, routed[index] = self._moe(layer.mlp, normed)
            else:
                out = layer.mlp(normed)
            hidden = hidden + out
        last = _norm(inner.norm, hidden[:, -1:])
        return LeanOutput(self.model.lm_head(last), routed)

    @staticmethod
    def _attention(layer, index: int, x, cos, sin, allowed, cache: DynamicCache | None) -> torch.Tensor:
        attn = layer.self_attn
        batch, length, _ = x.shape
        shape = (batch, length, -1, attn.head_dim)
        query = _norm(attn.q_norm, F.linear(x, attn.q_proj.weight).view(shape)).transpose(1, 2)
        key = _norm(attn.k_norm, F.linear(x, attn.k_proj.weight).view(shape)).transpose(1, 2)
        value = F.linear(x, attn.v_proj.weight).view(shape).transpose(1, 2)
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        if cache is not None:
            cached = cache.layers[index]
            if not isinstance(cached, DynamicLayer):
                raise TypeError(f"the lean forward keeps attention caches; layer {index} has a {type(cached).__name__}")
            key, value = cached.update(key, value)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=attn.scaling, enable_gqa=True)
        return F.linear(out.transpose(1, 2).reshape(batch, length, -1), attn.o_proj.weight)

    @staticmethod
    def _moe(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router (softmax over experts in float32 -> top-k -> renormalised when ``norm_topk_prob``) and the
        experts; returns the block's output and the top-k indices [B * S, k]."""
        router, rows = block.gate, x.reshape(-1, x.shape[-1])
        logits = F.linear(rows, router.weight)
        top_weight, top_index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), router.top_k, dim=-1)
        if router.norm_topk_prob:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        out = grouped_experts(block.experts, rows, top_index, top_weight.to(logits.dtype))
        return out.view_as(x), top_index


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm module's math: weight * x / sqrt(mean(x^2) + eps)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
