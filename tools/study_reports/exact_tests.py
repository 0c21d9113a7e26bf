"""Exact one-sided tests for small studies (a handful of runs per arm), by enumeration.

    mann_whitney_greater(x, y): P(U >= u) under H0, U = #{(i, j): x_i > y_j} + 0.5 #{x_i = y_j}, every split of
        the pooled values into groups of len(x) and len(y) equally likely (a permutation test, so ties are
        exact too); H1: x tends to exceed y.
    fisher_greater(a, n_a, b, n_b): P(X >= a), X hypergeometric with the table's margins (a of n_a events in
        one arm, b of n_b in the other); H1: the first arm's rate is higher.

Design decisions:
- Enumeration, not a library: no dependency for two formulas; 5 against 5 is 252 splits, 8 against 8 is 12,870
  (``MAX_SPLITS`` bounds it and names the size when exceeded). Values agree with scipy.stats'
  ``mannwhitneyu(method="exact")`` (no ties) and ``fisher_exact(alternative="greater")``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations

MAX_SPLITS = 1_000_000


def u_statistic(x: Sequence[float], y: Sequence[float]) -> float:
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)


def mann_whitney_greater(x: Sequence[float], y: Sequence[float]) -> float:
    """One-sided exact p-value of H1: x tends to exceed y."""
    pooled = [*x, *y]
    splits = math.comb(len(pooled), len(x))
    if splits > MAX_SPLITS:
        raise ValueError(f"{len(x)} against {len(y)} values is {splits} splits (> {MAX_SPLITS}); use fewer runs")
    observed = u_statistic(x, y)
    at_least = 0
    for chosen in combinations(range(len(pooled)), len(x)):
        picked = set(chosen)
        first = [pooled[i] for i in chosen]
        rest = [v for i, v in enumerate(pooled) if i not in picked]
        at_least += u_statistic(first, rest) >= observed - 1e-12
    return at_least / splits


def fisher_greater(a: int, n_a: int, b: int, n_b: int) -> float:
    """One-sided exact p-value of H1: a / n_a is the higher rate (P(X >= a), X hypergeometric)."""
    events, total = a + b, n_a + n_b
    return sum(math.comb(n_a, k) * math.comb(n_b, events - k) for k in range(a, min(n_a, events) + 1)) / math.comb(
        total, events
    )
