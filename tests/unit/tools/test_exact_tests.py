"""tools/study_reports/exact_tests.py: exact one-sided Mann-Whitney and Fisher p-values, checked by hand on
small cases and against scipy.stats where it is installed."""

import random

import pytest

from study_reports.exact_tests import fisher_greater, mann_whitney_greater, u_statistic


def test_u_counts_pairs_and_half_ties():
    assert u_statistic([3, 2], [1, 2]) == 3.5  # 3>1, 3>2, 2>1, 2=2 (half)


def test_complete_separation_of_four_against_four_is_one_in_seventy():
    assert mann_whitney_greater([5, 6, 7, 8], [1, 2, 3, 4]) == pytest.approx(1 / 70)
    assert mann_whitney_greater([1, 2, 3, 4], [5, 6, 7, 8]) == pytest.approx(1.0)


def test_one_swapped_pair_doubles_the_tail():
    # U = 15 of 16: the splits with U >= 15 are the best one and the one with a single swap
    assert mann_whitney_greater([4.5, 6, 7, 8], [1, 2, 3, 5]) == pytest.approx(2 / 70)


def test_fisher_four_of_four_against_none_is_one_in_seventy_and_no_difference_is_one():
    assert fisher_greater(4, 4, 0, 4) == pytest.approx(1 / 70)  # C(4,4) C(4,0) / C(8,4)
    assert fisher_greater(0, 4, 0, 4) == pytest.approx(1.0)
    assert fisher_greater(2, 4, 1, 4) == pytest.approx((6 * 4 + 4 * 1) / 56)  # X >= 2 of the 3 events


def test_too_many_splits_are_refused_naming_the_size():
    with pytest.raises(ValueError, match="splits"):
        mann_whitney_greater(list(range(20)), list(range(20)))


def test_agrees_with_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for n_x, n_y in ((4, 4), (5, 3), (3, 6)):
        x = [rng.random() for _ in range(n_x)]
        y = [rng.random() + 0.2 for _ in range(n_y)]
        expected = stats.mannwhitneyu(x, y, alternative="greater", method="exact").pvalue
        assert mann_whitney_greater(x, y) == pytest.approx(expected)
    for a, n_a, b, n_b in ((3, 4, 1, 4), (5, 5, 2, 5), (1, 4, 3, 4)):
        expected = stats.fisher_exact([[a, n_a - a], [b, n_b - b]], alternative="greater")[1]
        assert fisher_greater(a, n_a, b, n_b) == pytest.approx(expected)
