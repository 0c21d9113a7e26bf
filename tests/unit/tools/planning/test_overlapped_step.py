"""The overlapped RL step (tools/planning/step_time.py: ``overlapped_step_s``, ``split_prediction``) by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from planning.step_time import RLStepTime, overlapped_step_s, split_prediction


def test_k0_takes_turns_and_k1_overlaps_a_constant_round_fully():
    assert overlapped_step_s([10.0], 6.0, 1.0, max_staleness=0) == 17.0  # 10 + 6 + 1
    assert overlapped_step_s([10.0], 6.0, 1.0, max_staleness=1) == 11.0  # max(10, 6) + 1
    assert overlapped_step_s([4.0], 6.0, 1.0, max_staleness=4) == 7.0  # max(4, 6) + 1: k above 1 adds nothing


def test_a_long_tail_is_absorbed_only_over_k_rounds():
    rounds = [2.0, 2.0, 2.0, 14.0]  # three short rounds, one long: mean 5
    assert overlapped_step_s(rounds, 6.0, 1.0, 0) == 12.0  # 5 + 6 + 1
    assert overlapped_step_s(rounds, 6.0, 1.0, 1) == 9.0  # (6 + 6 + 6 + 14) / 4 + 1
    # k = 2, windows (2,2) (2,2) (2,14) (14,2): means 2, 2, 8, 8 -> (6 + 6 + 8 + 8) / 4 + 1
    assert overlapped_step_s(rounds, 6.0, 1.0, 2) == 8.0
    assert overlapped_step_s(rounds, 6.0, 1.0, 4) == 7.0  # every window's mean 5: max(5, 6) + 1
    with pytest.raises(ValueError, match="max_staleness -1 >= 0"):
        overlapped_step_s(rounds, 6.0, 1.0, -1)


def test_the_split_scales_each_side_by_its_gpus_and_the_filled_tail():
    # colocated on 8 GPUs: rollout 60, training 20 + 20 + 60 = 100, sync 2 -> 162 s
    colocated = RLStepTime(60.0, 20.0, 20.0, 60.0, 2.0, overlapped=False)
    split = split_prediction(colocated, gpus=8, rollout_gpus=2, mean_response_frac=0.25)
    assert (split.colocated_s, split.rollout_s, split.training_s) == (162.0, 240.0, 100.0 * 8 / 6)
    assert split.filled_rollout_s == 60.0  # 240 x 0.25
    assert split.split_s(0) == pytest.approx(240.0 + 800.0 / 6 + 2.0)
    assert split.split_s(1) == 242.0  # max(240, 133.3) + 2: each round waits for its longest
    assert split.split_s(2) == pytest.approx(800.0 / 6 + 2.0)  # max(60, 133.3) + 2
    assert split.speedup(2) == pytest.approx(162.0 / (800.0 / 6 + 2.0))
    with pytest.raises(ValueError, match="give 1 .. 7 of the 8 GPUs"):
        split_prediction(colocated, gpus=8, rollout_gpus=8)


def test_plan_prints_the_split_for_the_30b_colocated_recipe(capsys):
    tool = Path(__file__).resolve().parents[4] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", tool)
    assert spec is not None and spec.loader is not None
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)
    arguments = ["+experiment=qwen3_30b_a3b_8xh100", "rollout.sglang.model_path=/ckpt", "--gpus", "8"]
    assert plan_tool.main([*arguments, "--rollout-gpus", "2", "--mean-response-frac", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "split 6 training + 2 rollout GPUs" in out
    assert all(f"  {k}: " in out for k in ("k = 0", "k = 1", "k >= 2"))


def test_a_one_gpu_plan_prints_no_split():
    """Before: ``tools/plan.py --gpus 1`` (the calibration's default) died in the split, 'rollout GPUs 1: give 1 .. 0
    of the 1 GPUs'; one GPU has nothing to split."""
    tool = Path(__file__).resolve().parents[4] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", tool)
    assert spec is not None and spec.loader is not None
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)
    assert plan_tool.main(["--gpus", "1"]) == 0
