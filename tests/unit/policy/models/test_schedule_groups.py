"""The interleaved schedule's micro-batch groups (``policy/models/schedule.py:microbatch_group_size``), against the
two checks megatron-core's ``forward_backward_pipelining_with_interleaving`` makes: the group size lies in
[pp, M], and the last group's remainder is 0 or >= pp."""

from __future__ import annotations

import pytest

from gspo_megatron.policy.models.schedule import ScheduleError, microbatch_group_size


def _megatron_accepts(size: int, micro_batches: int, pp: int) -> bool:
    remainder = micro_batches % size
    return pp <= size <= micro_batches and not 0 < remainder < pp


@pytest.mark.parametrize(
    "micro_batches, pp, expected",
    [(2, 2, 2), (4, 2, 2), (5, 2, 3), (3, 2, 3), (7, 4, 7), (8, 4, 4), (9, 4, 5), (10, 4, 5), (6, 4, 6)],
)
def test_group_size_by_hand(micro_batches, pp, expected):
    """pp when it divides M; else the smallest size whose remainder megatron takes: 5 over pp 2 in groups
    of 3 (remainder 2); 9 over pp 4 in groups of 5 (4 leaves 1, 5 leaves 4); 7 over pp 4 needs one group
    of 7 (4, 5, 6 leave 3, 2, 1)."""
    size = microbatch_group_size(micro_batches, pp)
    assert size == expected and _megatron_accepts(size, micro_batches, pp)


def test_every_count_gets_a_size_megatron_accepts():
    for pp in range(2, 9):
        for micro_batches in range(pp, 64):
            size = microbatch_group_size(micro_batches, pp)
            assert _megatron_accepts(size, micro_batches, pp), (micro_batches, pp, size)
            assert all(not _megatron_accepts(s, micro_batches, pp) for s in range(pp, size))  # the smallest


def test_fewer_micro_batches_than_stages_are_refused_naming_the_fix():
    with pytest.raises(ScheduleError, match="1 micro-batches cannot fill 2 pipeline stages.*parallel.vpp=1"):
        microbatch_group_size(1, 2)
