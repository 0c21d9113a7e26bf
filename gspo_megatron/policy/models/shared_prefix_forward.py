"""Feed a micro-batch's shared-prefix layout (``contracts/shared_prefix.py``) to a megatron GPTModel chunk.

    logits_rows = model(packed tokens, packed positions, packed mask).flatten(0, 1)[index]   # [b, s, V/tp]

Autograd through the gather sums the gradients of the rows that share a packed position (the prompt): the
gradient of the row layout's loss, exactly.

Design decisions:
- RoPE at explicit positions: megatron's ``GPTModel._preprocess`` builds the rotary table for positions
  0..S'-1 (``RotaryEmbedding.forward(max_seq_len)`` -> [S', 1, 1, d]) and ignores ``position_ids``. For the
  duration of the forward, ``packed_positions`` replaces the model's ``rotary_pos_emb.forward`` (an instance
  attribute over megatron's cached method, always removed on exit) with one that returns megatron's own table
  for 0..max(position), indexed by the positions: [S', G, 1, d]. The unfused ``_apply_rotary_pos_emb_bshd``
  computes ``t * cos(freqs) + rotate_half(t) * sin(freqs)`` on [S', G, heads, d], which broadcasts the per-row
  table over the heads (read in megatron-core 0.16.1, 0.19.0 and main at 0.20.0.dev: main only squeezes a
  freqs with one more dim than t, which this table does not have; ``GPTModel._preprocess`` calls it alike).
  Refused (``SharedPrefixError``) where that does not hold: YaRN / multimodal rotary modules (another
  ``forward`` signature), fused RoPE, MLA.
- The mask needs a core attention that applies an arbitrary ``attention_mask``: the project's
  ``SDPACoreAttention`` (portable layer spec) does; TransformerEngine's causal attention ignores it, so every
  attention layer is checked to be ``SDPACoreAttention`` (linear-attention layers have none: refused too).
- Routing recordings stay in the row layout: each MoE router's ``RouterReplay`` is given
  ``ROUTER_TOKEN_ORDER`` (``SharedPrefixLayout.router_token_order``) for the forward, and
  ``policy/routing/replay.py`` reorders what it records (indices, margins) by it. A router set to replay
  (targets in the row layout) is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gspo_megatron.contracts.shared_prefix import SharedPrefixLayout

# attribute set on RouterReplay instances during a packed forward: (order [s * b], packed token count G * S')
ROUTER_TOKEN_ORDER = "gspo_shared_prefix_token_order"


class SharedPrefixError(ValueError):
    """A model the shared-prefix forward cannot serve; the message names the fix."""


_FIX = "set trainer.shared_prefix=false"


def _check_model(model: torch.nn.Module):
    """The model's one plain RotaryEmbedding, after checking every attention layer (module notes)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.attention import Attention

    from gspo_megatron.policy.models.layers import SDPACoreAttention

    rotary = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    if len(rotary) != 1 or type(rotary[0]) is not RotaryEmbedding:
        kinds = sorted({type(m).__name__ for m in rotary}) or ["none"]
        raise SharedPrefixError(
            f"the shared-prefix forward needs plain RoPE (megatron's RotaryEmbedding), this model has {kinds}; {_FIX}"
        )
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    layers = [m for m in model.modules() if hasattr(m, "self_attention")]
    if not attentions or len(attentions) != len(layers):
        raise SharedPrefixError(
            f"the shared-prefix forward needs softmax attention in every layer ({len(attentions)} of {len(layers)} "
            f"layers have it: linear-attention layers see every earlier token); {_FIX}"
        )
    config = attentions[0].config
    if config.apply_rope_fusion or config.multi_latent_attention:
        raise SharedPrefixError(f"the shared-prefix forward needs unfused RoPE and no MLA; {_FIX}")
    for attention in attentions:
        if not isinstance(attention.core_attention, SDPACoreAttention):
            raise SharedPrefixError(
                f"the shared-prefix forward needs the portable core attention (SDPACoreAttention, which applies an "
                f"arbitrary mask), this model has {type(attention.core_attention).__name__}; set "
                f"model.layer_spec=portable or {_FIX}"
            )
    return rotary[0]


@contextmanager
def packed_positions(model: torch.nn.Module, layout: SharedPrefixLayout) -> Iterator[None]:
    """Within: ``model``'s rotary table follows ``layout.position_ids`` and its routers' recordings are kept in
    the row layout's token order (module notes). Always undone on exit."""
    rotary = _check_model(model)
    positions = layout.position_ids.t()  # [S', G]: megatron's sequence-first order
    original = rotary.forward  # megatron's (cached) bound method

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        if max_seq_len != positions.shape[0] or offset or packed_seq:
            raise SharedPrefixError(
                f"the rotary table was asked for {max_seq_len} positions (offset {offset}, packed {packed_seq}), "
                f"the shared-prefix layout feeds {positions.shape[0]}; {_FIX}"
            )
        table = original(int(positions.max()) + 1)  # [n, 1, 1, d]: megatron's own freqs for 0..n-1
        return table[:, 0, 0][positions.to(table.device)].unsqueeze(2)  # [S', G, 1, d]

    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = [r for m in model.modules() if (r := getattr(m, "router_replay", None)) is not None]
    if any(router.router_replay_action == RouterReplayAction.REPLAY_FORWARD for router in routers):
        raise SharedPrefixError(f"routing replay targets are in the row layout, not the packed one; {_FIX}")
    given = (layout.router_token_order().cpu(), layout.tokens.numel())
    rotary.forward = forward
    for router in routers:
        setattr(router, ROUTER_TOKEN_ORDER, given)
    try:
        yield
    finally:
        del rotary.forward  # megatron's method again
        for router in routers:
            delattr(router, ROUTER_TOKEN_ORDER)


def forward_packed(model: torch.nn.Module, layout: SharedPrefixLayout) -> torch.Tensor:
    """The model's output on the packed layout, gathered back to the row layout: [b, s, ...] (module notes)."""
    with packed_positions(model, layout):
        output = model(layout.tokens, layout.position_ids, attention_mask=layout.attention_mask)
    return output.flatten(0, 1)[layout.index]
