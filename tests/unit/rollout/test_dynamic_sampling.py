"""DAPO dynamic sampling: full batches of informative groups, bounded rounds, never short or empty."""

import pytest

from gspo_megatron.rollout.dynamic_sampling import collect_informative_groups


def _rounds(plan):
    """draw_round over a scripted plan: round r yields groups (r, i, informative?)."""
    calls = []

    def draw(round_index):
        calls.append(round_index)
        return [(round_index, i, flag) for i, flag in enumerate(plan[round_index])]

    return draw, calls


def test_draws_more_rounds_until_the_batch_is_full_and_drops_the_surplus():
    draw, calls = _rounds([[True, False, False, True], [False, True, True, True]])
    out = collect_informative_groups(draw, lambda g: g[2], needed=4, max_extra_rounds=3)
    assert calls == [0, 1]
    assert out.groups == [(0, 0, True), (0, 3, True), (1, 1, True), (1, 2, True)]
    assert (out.rounds, out.drawn, out.filtered, out.padded) == (2, 8, 3, 0)
    assert out.metrics()["dynamic_sampling/filtered_frac"] == pytest.approx(3 / 8)
    assert out.metrics()["dynamic_sampling/extra_rounds"] == 1.0


def test_terminates_with_a_full_batch_when_every_group_is_degenerate():
    draw, calls = _rounds([[False] * 3] * 10)
    out = collect_informative_groups(draw, lambda g: g[2], needed=3, max_extra_rounds=2)
    assert calls == [0, 1, 2]  # 1 + max_extra_rounds, then stop
    assert len(out.groups) == 3 and out.padded == 3 and out.filtered == 9
    assert out.metrics()["dynamic_sampling/filtered_frac"] == 1.0


def test_short_of_informative_groups_pads_with_degenerate_ones_after_the_last_round():
    draw, calls = _rounds([[True, False, False], [False, True, False]])
    out = collect_informative_groups(draw, lambda g: g[2], needed=3, max_extra_rounds=1)
    assert calls == [0, 1]
    assert out.groups == [(0, 0, True), (1, 1, True), (0, 1, False)]
    assert out.padded == 1


def test_first_round_enough_means_no_extra_round_and_bad_arguments_are_named():
    draw, calls = _rounds([[True, True]])
    out = collect_informative_groups(draw, lambda g: g[2], needed=2, max_extra_rounds=0)
    assert calls == [0] and out.rounds == 1 and out.filtered == 0
    with pytest.raises(ValueError, match="max_extra_rounds must be >= 0"):
        collect_informative_groups(draw, lambda g: g[2], needed=2, max_extra_rounds=-1)
    with pytest.raises(RuntimeError, match="returned no groups"):
        collect_informative_groups(lambda r: [], lambda g: True, needed=2, max_extra_rounds=1)
