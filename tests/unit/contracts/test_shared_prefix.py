"""The shared-prefix layout (contracts/shared_prefix.py) on hand-built micro-batches, every field hand-computed."""

from __future__ import annotations

import torch

from gspo_megatron.contracts.shared_prefix import build_shared_prefix_layout


def _rows(prompts: list[list[int]], responses: list[list[int]], width: int):
    """inputs [b, width], response_mask and input_mask of rows prompt + response (the response's last token
    is the final target, so the fed inputs are prompt + response[:-1])."""
    b = len(prompts)
    tokens = torch.zeros(b, width, dtype=torch.long)
    response_mask = torch.zeros(b, width)
    input_mask = torch.zeros(b, width)
    for r, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        fed = prompt + response[:-1]
        tokens[r, : len(fed)] = torch.tensor(fed)
        input_mask[r, : len(fed)] = 1
        response_mask[r, len(prompt) - 1 : len(prompt) - 1 + len(response)] = 1
    return tokens, response_mask, input_mask


def test_two_groups_hand_computed():
    # group 0: prompt [5, 6, 7] with responses [1, 2] and [3]; group 1: prompt [8, 9] with response [4, 4, 4]
    tokens, response_mask, input_mask = _rows([[5, 6, 7], [5, 6, 7], [8, 9]], [[1, 2], [3], [4, 4, 4]], width=5)
    # fed rows: [5 6 7 1 .], [5 6 7 . .], [8 9 4 4 .]
    layout = build_shared_prefix_layout(tokens, response_mask, input_mask)
    assert layout is not None
    # group 0: prompt 5 6 7 | row 0's input 1 | (row 1 has none); group 1: 8 9 | 4 4 (one group, one row)
    assert layout.tokens.tolist() == [[5, 6, 7, 1], [8, 9, 4, 4]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert layout.group_of_row.tolist() == [0, 0, 1]
    s = 4  # packed width
    assert layout.index.tolist() == [
        [0, 1, 2, 3, 0],  # row 0: prompt 0..2, its response input at 3, padding -> the group's first input
        [0, 1, 2, 0, 0],  # row 1: prompt only (its one response token is scored at the prompt's last input)
        [s + 0, s + 1, s + 2, s + 3, s + 0],
    ]
    # group 0 segments [0 0 0 1]: causal; group 1 segments [0 0 1 1]: causal
    causal = ~torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(layout.attention_mask[0, 0], causal)
    assert torch.equal(layout.attention_mask[1, 0], causal)


def test_responses_do_not_see_each_other_and_pads_see_themselves():
    tokens, response_mask, input_mask = _rows([[5, 6], [5, 6]], [[1, 2, 3], [4, 9]], width=5)
    # fed rows: [5 6 1 2 .], [5 6 4 . .]
    layout = build_shared_prefix_layout(tokens, response_mask, input_mask, multiple=4)
    assert layout is not None
    assert layout.tokens.tolist() == [[5, 6, 1, 2, 4, 0, 0, 0]]  # width 5 rounded up to 8
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 0, 0]]
    assert layout.index.tolist() == [[0, 1, 2, 3, 0], [0, 1, 4, 0, 0]]
    visible = ~layout.attention_mask[0, 0]
    expected = torch.tensor(
        [  # segments 0 0 1 1 2 pad pad pad
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 0],  # row 1's input sees the prompt and itself, not row 0's inputs
            [0, 0, 0, 0, 0, 1, 0, 0],  # padding: itself only
            [0, 0, 0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(visible, expected)


def test_differing_prompts_and_router_order():
    # rows 0, 1 share [5, 6]; row 2 has [5, 7] (same length, other tokens): its own group; row 3 shares row 2's
    tokens, response_mask, input_mask = _rows([[5, 6], [5, 6], [5, 7], [5, 7]], [[1, 2]] * 4, width=3)
    layout = build_shared_prefix_layout(tokens, response_mask, input_mask)
    assert layout is not None
    assert layout.group_of_row.tolist() == [0, 0, 1, 1]
    assert layout.tokens.tolist() == [[5, 6, 1, 1], [5, 7, 1, 1]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 2], [0, 1, 2, 2]]
    # router order: row layout token (t, r) at t * b + r <- packed (j, g) at j * G + g
    order = layout.router_token_order()
    packed_router = torch.arange(4 * 2)  # the packed forward's tokens in router order, labelled by index
    rows_router = packed_router[order].view(3, 4)  # [s, b]
    for r in range(4):
        for t in range(3):
            flat = int(layout.index[r, t])
            g, j = divmod(flat, 4)
            assert int(rows_router[t, r]) == j * 2 + g


def test_nothing_shared_or_not_right_padded_gives_none():
    tokens, response_mask, input_mask = _rows([[5, 6], [7, 8]], [[1, 2], [1, 2]], width=3)
    assert build_shared_prefix_layout(tokens, response_mask, input_mask) is None
    tokens, response_mask, input_mask = _rows([[5, 6], [5, 6]], [[1, 2], [1, 2]], width=3)
    input_mask[0] = torch.tensor([0.0, 1.0, 1.0])  # left padding: not this layout
    assert build_shared_prefix_layout(tokens, response_mask, input_mask) is None


def test_gather_reproduces_row_layout_of_a_position_function():
    """A stand-in model whose output at a position is a function of the token, its position and the tokens it
    sees: the packed output gathered by ``index`` equals the row layout's at every real input."""
    torch.manual_seed(0)
    prompts = [[3, 1, 4], [3, 1, 4], [3, 1, 4], [2, 7]]
    responses = [[5, 9, 2], [6], [5, 3], [8, 8, 1, 1]]
    tokens, response_mask, input_mask = _rows(prompts, responses, width=6)
    layout = build_shared_prefix_layout(tokens, response_mask, input_mask)
    assert layout is not None

    def model(tokens, positions, visible):  # out[b, q] = sum over visible keys of token * 10^position, + q's position
        weights = tokens.double() * 10.0 ** positions.double()
        return (visible.double() * weights.unsqueeze(-2)).sum(-1) + positions.double() / 7

    b, s = tokens.shape
    causal = torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s)
    rows = model(tokens, torch.arange(s).expand(b, s), causal)
    packed = model(layout.tokens, layout.position_ids, ~layout.attention_mask[:, 0])
    gathered = packed.flatten(0, 1)[layout.index]
    real = input_mask.bool()
    assert torch.equal(gathered[real], rows[real])


def test_micro_batch_carries_the_layout():
    import pytest

    from gspo_megatron.contracts.micro_batch import MicroBatch

    tokens, response_mask, input_mask = _rows([[5, 6], [5, 6]], [[1, 2], [3, 4]], width=3)
    layout = build_shared_prefix_layout(tokens, response_mask, input_mask)
    mb = MicroBatch(tokens=tokens, targets=tokens, response_mask=response_mask, shared_prefix=layout)
    assert "shared_prefix" not in mb.tensors()
    moved = mb.to("cpu")
    assert moved.shared_prefix is not None and torch.equal(moved.shared_prefix.index, layout.index)
    with pytest.raises(ValueError, match="shared-prefix layout"):
        mb.map_per_token(lambda value: value[:, :1])
