"""tools/bench_threads.py's schedule and table (its smoke run, which starts the main job, is in
test_bench_smoke.py)."""

from __future__ import annotations

import argparse

import bench_threads
import pytest
from bench_threads import DEFAULT, Run, rotated, table, thread_counts


def test_repetitions_rotate_the_order_so_every_setting_takes_every_place():
    settings = [DEFAULT, "1", "2"]
    orders = [rotated(settings, repetition) for repetition in range(len(settings))]
    assert all(sorted(order) == sorted(settings) for order in orders)
    for place in range(len(settings)):
        assert sorted(order[place] for order in orders) == sorted(settings)


def test_the_table_rates_each_setting_by_its_median_wall_time_against_the_best():
    runs = [
        Run(DEFAULT, 12.0, 0.5, 1, "rule"),
        Run(DEFAULT, 14.0, 0.7, 1, "rule"),
        Run(DEFAULT, 13.0, 0.6, 1, "rule"),
        Run("1", 10.0, None, 1, "env"),
        Run("2", 20.0, 0.9, 2, "env"),
    ]
    lines = table(runs, [DEFAULT, "1", "2"]).splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert rows[DEFAULT][1:5] == ["1", "13.0", "12.0-14.0", "0.600"]
    assert rows["OMP_NUM_THREADS=1"][4:] == ["-", "1.00x"]  # one step per run: no step interval
    assert rows["OMP_NUM_THREADS=2"][5] == f"{20.0 / 10.0:.2f}x"
    assert lines[-1].startswith(f"default / best = {13.0 / 10.0:.2f} ")


@pytest.mark.parametrize("text", ["0", "1,x", "", "-2"])
def test_settings_are_positive_thread_counts(text):
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated thread counts >= 1"):
        thread_counts(text)
    assert thread_counts("1,2") == [1, 2]
    assert bench_threads.environment("2")["OMP_NUM_THREADS"] == "2"
    assert "OMP_NUM_THREADS" not in bench_threads.environment(DEFAULT)
