"""Markdown cells the pre-registered studies' reports (E1-E4) share: a statistic and an exact test's result.

Each report module wrote its own copy of these before; the text they produce is part of each stored
``report.md``, so a change here changes every such report (``regenerate_report.py --check`` compares their
``report.json``; the markdown follows from it).
"""

from __future__ import annotations


def stat_cell(stat: dict | None, digits: int = 3) -> str:
    """``mean ± std`` of a ``Stat.to_dict()``, ``--`` when there is none."""
    if not stat or stat.get("mean") is None:
        return "--"
    return f"{stat['mean']:.{digits}g} ± {stat['std']:.2g}"


def exact_test_cell(test: dict, count_key: str, show_n: bool = False) -> str:
    """An exact one-sided test's p with what it compared: counts under ``count_key`` (Fisher) or medians
    (Mann-Whitney, with the sample sizes when ``show_n``); ``--`` when the test could not run."""
    if test["p"] is None:
        return "--"
    if count_key in test:
        (a, b), (n_a, n_b) = test[count_key], test["n"]
        return f"p = {test['p']:.3g} ({count_key} {a}/{n_a} vs {b}/{n_b})"
    medians = f"medians {test['median_x']:.3g} vs {test['median_y']:.3g}"
    if show_n:
        (n_x, n_y) = test["n"]
        return f"p = {test['p']:.3g} ({medians}, n {n_x} vs {n_y})"
    return f"p = {test['p']:.3g} ({medians})"
