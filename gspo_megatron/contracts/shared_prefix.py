"""Shared-prefix layout of a micro-batch (``trainer.shared_prefix``; "Prefix Grouper", arXiv 2506.05433).

A GRPO/GSPO micro-batch holds ``group_size`` consecutive rows of the same prompt. Under causal attention
the prompt's positions never see the responses, so their hidden states (and the logits at the prompt's
last input, which score the first response token) are the same in every row of the group. This module
lays a micro-batch out so the model computes them once:

    row layout  [b, s]:  row r = prompt_r | response_r | pad
    packed      [G, S']: group g = prompt_g | response_(g,1) | ... | response_(g,n) | pad

Definitions, for row r with real inputs ``L_r = sum(input_mask[r])`` (right-padded):
- ``t0_r`` = the first t with ``response_mask[r, t] = 1`` (the first response target), so the prompt's
  inputs are ``tokens[r, 0..t0_r]`` (``P_r = t0_r + 1`` of them; the last one scores the first response
  token) and the row's own inputs are ``tokens[r, P_r..L_r-1]`` (``R_r = L_r - P_r``). A row with no
  response target is all prompt (``P_r = L_r``, ``R_r = 0``).
- A group is a maximal run of consecutive rows with equal ``P`` and equal prompt tokens; a row whose prompt
  differs from its group's first row starts a new group.
- Packed group g (rows r_1..r_n, prompt length P): index ``j < P`` is prompt input j; row r_k's inputs
  follow at ``offset_k = P + R_(r_1) + ... + R_(r_(k-1))``; the rest up to S' is padding.
- Positions (RoPE): prompt j -> j; row r_k's input at offset_k + i -> P + i (= its position in the row
  layout); padding -> 0.
- Attention mask (megatron's convention, True = masked out), query q, key k of one group, with segment
  ``seg`` = 0 for the prompt, k for row r_k's inputs, -1 for padding:
      visible(q, k) = k <= q and (seg[k] = 0 or seg[k] = seg[q])   for seg[q] >= 0
      visible(q, k) = (k = q)                                       for padding (seg[q] = -1)
  (a query sees the prompt keys at or before it and its own row's keys at or before it: exactly the keys
  it sees in its row under the causal mask, at the same positions).
- Gather index [b, s] -> flat packed index (``g * S' + j``): ``packed.flatten(0, 1)[index]`` is the row
  layout at every real input (t < L_r). Padding inputs of the row layout (t >= L_r) map to their group's
  first prompt input (``g * S'``): real logits, masked out of every loss by ``input_mask`` /
  ``response_mask`` like any padding position.

Cost: a group's token-wise work scales with P + R_1 + ... + R_n instead of n P + sum R, its attention with
(P + sum R)^2 instead of sum (P + R)^2, and the mask holds S'^2 booleans per group: it pays where prompts are
long next to the responses (docs/training.md).

Pure tensor code (torch only): ``policy/models/shared_prefix_forward.py`` feeds the layout to the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class SharedPrefixLayout:
    """The packed layout of one micro-batch (module docstring): G groups of S' packed inputs."""

    tokens: torch.Tensor  # long [G, S']: packed inputs (padding: 0)
    position_ids: torch.Tensor  # long [G, S']: RoPE positions
    attention_mask: torch.Tensor  # bool [G, 1, S', S']: True = masked out (megatron's convention)
    index: torch.Tensor  # long [b, s]: row-layout (r, t) -> flat packed index g * S' + j
    group_of_row: torch.Tensor  # long [b]: each row's group

    @property
    def num_groups(self) -> int:
        return self.tokens.shape[0]

    @property
    def packed_len(self) -> int:
        return self.tokens.shape[1]

    def to(self, device: torch.device | str) -> SharedPrefixLayout:
        return SharedPrefixLayout(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})

    def router_token_order(self) -> torch.Tensor:
        """long [s * b]: for each token of the row layout in megatron's router order (sequence-major: t * b + r),
        its index in the packed layout's router order (sequence-major: j * G + g). ``routing[order]`` turns a
        packed forward's [S' * G, k] routing into the row layout's [s * b, k]."""
        group, offset = self.index // self.packed_len, self.index % self.packed_len  # [b, s] each
        return (offset * self.num_groups + group).t().reshape(-1)


def _prompt_lengths(response_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """long [b]: P_r = first response target + 1, or L_r where the row has no response target."""
    has_response = response_mask.bool().any(dim=1)
    first = response_mask.bool().int().argmax(dim=1)
    return torch.where(has_response, first + 1, lengths)


def build_shared_prefix_layout(
    tokens: torch.Tensor,
    response_mask: torch.Tensor,
    input_mask: torch.Tensor,
    *,
    multiple: int = 1,
) -> SharedPrefixLayout | None:
    """The packed layout of a micro-batch's [b, s] ``tokens`` (module docstring), or None where nothing is
    shared (every group one row) or the layout does not apply (an ``input_mask`` that is not right padding).

    ``multiple``: S' is rounded up to it (the fed length's multiple under sequence parallelism).
    """
    num_rows, seq_len = tokens.shape
    real = input_mask.bool()
    lengths = real.sum(dim=1)
    right_padded = torch.arange(seq_len, device=real.device).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(real, right_padded):
        return None
    prompt = _prompt_lengths(response_mask, lengths).tolist()
    lengths_list = lengths.tolist()
    tokens_cpu = tokens.cpu()

    groups: list[list[int]] = []
    for row in range(num_rows):
        if groups:
            first = groups[-1][0]
            p = prompt[row]
            if p == prompt[first] and torch.equal(tokens_cpu[row, :p], tokens_cpu[first, :p]):
                groups[-1].append(row)
                continue
        groups.append([row])
    if len(groups) == num_rows:
        return None

    widths = [prompt[g[0]] + sum(lengths_list[r] - prompt[r] for r in g) for g in groups]
    packed_len = -(-max(widths) // multiple) * multiple
    num_groups = len(groups)
    packed = torch.zeros(num_groups, packed_len, dtype=tokens.dtype)
    positions = torch.zeros(num_groups, packed_len, dtype=torch.long)
    segment = torch.full((num_groups, packed_len), -1, dtype=torch.long)
    index = torch.zeros(num_rows, seq_len, dtype=torch.long)
    group_of_row = torch.zeros(num_rows, dtype=torch.long)
    for g, rows in enumerate(groups):
        p = prompt[rows[0]]
        base = g * packed_len
        packed[g, :p] = tokens_cpu[rows[0], :p]
        positions[g, :p] = torch.arange(p)
        segment[g, :p] = 0
        offset = p
        for k, row in enumerate(rows, start=1):
            n = lengths_list[row] - p
            packed[g, offset : offset + n] = tokens_cpu[row, p : p + n]
            positions[g, offset : offset + n] = torch.arange(p, p + n)
            segment[g, offset : offset + n] = k
            index[row, :p] = base + torch.arange(p)
            index[row, p : p + n] = base + offset + torch.arange(n)
            index[row, p + n :] = base  # padding: the group's first prompt input (module docstring)
            group_of_row[row] = g
            offset += n

    query, key = segment.unsqueeze(2), segment.unsqueeze(1)  # [G, S', 1], [G, 1, S']
    causal = torch.ones(packed_len, packed_len, dtype=torch.bool).tril()
    visible = causal & ((key == 0) | (key == query)) & (query >= 0)
    visible |= torch.eye(packed_len, dtype=torch.bool) & (query < 0)  # padding sees itself only
    device = tokens.device
    return SharedPrefixLayout(
        tokens=packed.to(device),
        position_ids=positions.to(device),
        attention_mask=(~visible).unsqueeze(1).to(device),
        index=index.to(device),
        group_of_row=group_of_row.to(device),
    )
