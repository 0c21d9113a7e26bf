"""``torch._grouped_mm``'s limits and the row padding bf16 on CPU runs the grouped GEMMs with, by hand
(``GroupedExperts`` against ``SequentialMLP`` in spawned ranks: tests/distributed/test_grouped_experts.py)."""

from __future__ import annotations

import torch


def test_grouped_mm_fits():
    from gspo_megatron.policy.models.grouped_experts import grouped_mm_fits

    cpu = torch.device("cpu")
    assert grouped_mm_fits(32, 32, 16, torch.float32, cpu)
    assert grouped_mm_fits(32, 12, 6, torch.bfloat16, cpu) is False  # 6 bf16 = 12 bytes
    assert grouped_mm_fits(30, 32, 16, torch.float32, cpu) is False
    assert grouped_mm_fits(32, 16, 8, torch.bfloat16, cpu)


def test_padded_positions_by_hand():
    """Rows sorted by expert, counts [3, 0, 5, 1], groups padded to 4: expert 0 keeps 0-2, expert 2
    starts at 4 (4-8), expert 3 at 12; padded counts [4, 0, 8, 4]."""
    from gspo_megatron.policy.models.grouped_experts import padded_positions

    positions, padded = padded_positions(torch.tensor([3, 0, 5, 1]), 4)
    assert positions.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 12]
    assert padded.tolist() == [4, 0, 8, 4]
    positions, padded = padded_positions(torch.tensor([0, 0]), 32)
    assert positions.tolist() == [] and padded.tolist() == [0, 0]


def test_padding_the_groups_changes_no_result():
    """The grouped GEMMs on zero-padded groups (as bf16 on CPU runs them) equal them on the rows as
    they come, forward and every gradient, in fp32 (a padded row contributes zeros). Within 1e-6, not
    bit for bit: a group's GEMM has more rows padded, and the BLAS may pick another kernel (another
    summation order) for another shape -- on an AMD EPYC the input gradient differed in 13 of 256
    elements by at most 4.8e-7 (relative 1.9e-6); on CI's machine it had been exact."""
    from gspo_megatron.policy.models.grouped_experts import GroupedLinear, padded_positions

    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])
    rows = torch.randn(16, 16, generator=generator)
    weights = [torch.randn(8, 16, generator=generator) for _ in range(4)]
    grad_out = torch.randn(16, 8, generator=generator)

    def run(pad: bool):
        x = rows.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in weights]
        group_counts, inputs, positions = counts, x, None
        if pad:
            positions, group_counts = padded_positions(counts, 32)
            inputs = x.new_zeros(int(group_counts.sum()), 16).index_copy(0, positions, x)
        out = GroupedLinear.apply(inputs, group_counts.cumsum(0).to(torch.int32), *ws)
        out = out if positions is None else out.index_select(0, positions)
        (out * grad_out).sum().backward()
        return out.detach(), x.grad, [w.grad for w in ws]

    (out, grad_rows, grad_weights), (out_p, grad_rows_p, grad_weights_p) = run(False), run(True)
    torch.testing.assert_close(out_p, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_rows_p, grad_rows, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grad_weights_p, grad_weights, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # sums over more (zero) rows
