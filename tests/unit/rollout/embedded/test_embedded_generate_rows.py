"""EmbeddedEngine.generate_rows: one sample per row with its own budget, stopping once enough groups are
complete. Rows draw from per-row generators, so a row's tokens do not depend on which rows share the batch
or when the call stops: a stopped row holds a prefix of what it would have generated."""

import pytest
import torch
from test_embedded_engine import engine_from, peaked_source_model, tiny_config

from gspo_megatron.contracts.samples import FinishReason, RowRequest, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
N = 2


@pytest.fixture(scope="module")
def source():
    return peaked_source_model(tiny_config())


def _rows(budget: int) -> list[RowRequest]:
    return [RowRequest(prompt, budget, group) for group, prompt in enumerate(PROMPTS) for _ in range(N)]


def test_rows_of_every_group_are_the_groups_generate_samples(source):
    engine = engine_from(source)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=N, seed=7, stop_token_ids=(3,))
    grouped = engine.generate(PROMPTS, params)
    rows = engine.generate_rows(_rows(6), params, groups_needed=len(PROMPTS))
    assert [s.output_ids for g in grouped for s in g] == [s.output_ids for s in rows]
    for a, b in zip([s for g in grouped for s in g], rows, strict=True):
        torch.testing.assert_close(a.output_log_probs, b.output_log_probs)
        assert a.finish_reason == b.finish_reason


def test_generation_stops_once_enough_groups_are_complete(source):
    """Budgets 2 for group 0, 12 for the others: once group 0's rows finish, one group is complete and the
    rest stop (ABORT) with the tokens they have -- each a prefix of its full generation."""
    engine = engine_from(source, max_batch_size=64)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=1, seed=3)
    rows = [RowRequest(row.prompt_ids, 2 if row.group == 0 else 12, row.group) for row in _rows(12)]
    full = engine.generate_rows(rows, params, groups_needed=len(PROMPTS))
    stopped = engine.generate_rows(rows, params, groups_needed=1)
    for row, whole, part in zip(rows, full, stopped, strict=True):
        if row.group == 0:
            assert part.finish_reason == FinishReason.LENGTH and len(part.output_ids) == 2
            assert part.output_ids == whole.output_ids
        else:
            assert part.finish_reason == FinishReason.ABORT and len(part.output_ids) == 2
            assert whole.output_ids[:2] == part.output_ids
            torch.testing.assert_close(whole.output_log_probs[:2], part.output_log_probs)


def test_later_chunks_do_not_start_once_enough_groups_are_complete(source):
    engine = engine_from(source, max_batch_size=2)  # one group per chunk
    params = SamplingParams(temperature=1.0, max_new_tokens=3, n=1, seed=1)
    samples = engine.generate_rows(_rows(3), params, groups_needed=1)
    assert [s.finish_reason for s in samples[:2]] == [FinishReason.LENGTH] * 2
    assert all(s.finish_reason == FinishReason.ABORT and s.output_ids == [] for s in samples[2:])


def test_a_row_needs_a_budget():
    with pytest.raises(ValueError, match="budget of >= 1 new tokens"):
        RowRequest([1, 2], 0, 0)
