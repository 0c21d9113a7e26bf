"""The run summary printed at the end of a job: hand-built histories, checked line by line."""

from __future__ import annotations

import json
import re
import time

import pytest

from gspo_megatron.core.run_dir import METRICS_FILE, read_jsonl
from gspo_megatron.run.run_log import RUN_WALL_KEY, RunLog, summary_text


def _step(step: int, reward: float, **extra) -> dict:
    clip = {"loss/clip_frac_seq": 0.05, "loss/clip_frac_token": 0.05}
    return {"step": step, "reward/mean": reward, "response/length_mean": 1.0, **clip, **extra}


def test_reward_windows_are_the_first_and_last_fifth():
    history = [_step(i + 1, float(i)) for i in range(10)]  # first fifth: 0, 1; last fifth: 8, 9
    text = summary_text(history, wall_s=30.0, plot=None)
    assert "10 steps in 0.5 min" in text
    assert "first 20%: 0.500   last 20%: 8.500" in text


def test_one_token_answers_print_no_nan_for_the_length_bucket():
    """One-token answers with no bucket logged: the summary says so, no nan."""
    history = [_step(i + 1, 0.5, **{"loss/ratio_token_seq_gap": 0.0}) for i in range(5)]
    text = summary_text(history, wall_s=6.0, plot=None)
    assert "nan" not in text
    assert "mean |w_t - s_i| = 0 (no length bucket measured)" in text


def test_routing_volatility_is_printed_with_its_first_and_last_fifth():
    # first fifth: 0.1, 0.1; last fifth: 0.0, 0.0 -> mean 0.05; the engine's line from the last fifth
    changed = [0.1, 0.1, 0.05, 0.05, 0.1, 0.05, 0.05, 0.0, 0.0, 0.0]
    history = [
        _step(i + 1, 0.5, **{"routing/update_changed_frac": c, "routing/rollout_vs_train_changed_frac": 0.25})
        for i, c in enumerate(changed)
    ]
    text = summary_text(history, wall_s=6.0, plot=None)
    assert (
        "expert sets changed by an update: 0.050 of tokens per layer (whole run; first 20%: 0.100, last 20%: 0.000);"
        " engine vs trainer (last 20%): 0.250" in text
    )
    assert "routing" not in summary_text([_step(1, 0.5)], wall_s=6.0, plot=None)


def test_clip_fractions_name_their_window():
    """Issue 64: "clip frac (seq) mean 0.1959" was the last 20% while the report's mean was the whole run."""
    history = [
        {**_step(i + 1, 0.5), "loss/clip_frac_seq": 0.1 * i, "loss/clip_frac_token": 0.01 * i} for i in range(10)
    ]
    text = summary_text(history, wall_s=6.0, plot=None)
    assert "clip frac (seq)   last 20%: 0.8500   (token) last 20%: 0.0850" in text


def test_an_r3_run_keeps_its_routing_volatility_line():
    """Issue 64: under R3 (routing.replay=rollout) no "update" kind is measured and the line disappeared."""
    history = [_step(i + 1, 0.5, **{"routing/rollout_vs_train_changed_frac": 0.0}) for i in range(5)]
    without_update = summary_text(history, wall_s=6.0, plot=None)  # no replay given: update just not in kinds
    assert "not measured (add update to routing.kinds); engine vs trainer (last 20%): 0.000" in without_update
    text = summary_text(history, wall_s=6.0, plot=None, replay="rollout")
    (line,) = [line for line in text.splitlines() if "routing volatility" in line]
    assert "expert sets changed by an update: not measured under R3 (routing.replay=rollout:" in line
    assert line.endswith("; engine vs trainer (last 20%): 0.000 (R3 replays the engine's routing: 0 expected)")


def test_the_run_log_passes_its_replay_mode_to_the_summary(tmp_path):
    log = RunLog(
        tmp_path,
        1,
        tensorboard=False,
        wandb_project=None,
        progress=False,
        config_yaml="",
        charts=False,
        replay="rollout",
    )
    log.log_step(1, {"reward/mean": 0.5, "routing/rollout_vs_train_changed_frac": 0.0})
    assert "not measured under R3" in log.close()


@pytest.mark.parametrize(
    ("bucket", "gap", "token", "seq", "expected"),
    [
        # 5-16 tokens, printed first where measured
        ("len_5_16", 0.02, 0.04, 0.01, "= 0.02 (token ratio spread E[(w-1)^2] 0.04 vs sequence 0.01 at 5-16 tokens)"),
        # the main job's answers are 3 tokens: the 1-4 bucket is the one measured
        ("len_1_4", 0.008, 0.03, 0.02, "= 0.008 (token ratio spread E[(w-1)^2] 0.03 vs sequence 0.02 at 1-4 tokens)"),
    ],
)
def test_the_measured_length_bucket_spreads_are_printed(bucket, gap, token, seq, expected):
    extra = {
        "loss/ratio_token_seq_gap": gap,
        f"loss/ratio_var_token/{bucket}": token,
        f"loss/ratio_var_seq/{bucket}": seq,
    }
    history = [_step(i + 1, 0.5, **extra) for i in range(5)]
    text = summary_text(history, wall_s=6.0, plot=None)
    assert f"mean |w_t - s_i| {expected}" in text


def test_wall_time_covers_the_whole_run_across_a_resume(tmp_path):
    """A run resumed at step 3 after an earlier process spent 600 s: the summary times all 4 steps."""
    earlier = [{**_step(i + 1, 0.5), RUN_WALL_KEY: 200.0 * (i + 1)} for i in range(3)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in earlier))
    before = time.monotonic()
    log = RunLog(tmp_path, 4, tensorboard=False, wandb_project=None, progress=False, config_yaml="", resume_step=3)
    log.log_step(4, {k: v for k, v in _step(4, 0.75).items() if k != "step"})
    this_process = time.monotonic() - before
    walls = [r[RUN_WALL_KEY] for r in read_jsonl(tmp_path / METRICS_FILE)]
    assert walls[:3] == [200.0, 400.0, 600.0] and 600.0 <= walls[3] <= 600.0 + this_process
    text = log.close()
    minutes = float(re.search(r"4 steps in ([0-9.]+) min", text).group(1))
    assert minutes >= 10.0 and "(resumed at step 3:" in text


def test_a_fresh_run_starts_its_clock_at_zero(tmp_path):
    before = time.monotonic()
    log = RunLog(tmp_path, 1, tensorboard=False, wandb_project=None, progress=False, config_yaml="")
    log.log_step(1, {"reward/mean": 0.5})
    (record,) = read_jsonl(tmp_path / METRICS_FILE)
    assert 0.0 <= record[RUN_WALL_KEY] <= time.monotonic() - before
    assert "resumed" not in log.close()


@pytest.mark.parametrize("charts", [True, False])
def test_the_reward_curve_is_drawn_only_with_charts(tmp_path, charts):
    """logging.charts=false: no reward_curve.png and no line for it; the numbers are all written."""
    log = RunLog(tmp_path, 1, tensorboard=False, wandb_project=None, progress=False, config_yaml="", charts=charts)
    log.log_step(1, {k: v for k, v in _step(1, 0.5).items() if k != "step"})
    text = log.close()
    assert (tmp_path / "reward_curve.png").is_file() == charts
    assert ("reward curve:" in text) == charts
    assert [r["reward/mean"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [0.5]


def test_the_trainer_run_log_knows_the_configs_replay_mode(tmp_path):
    """``open_run_log`` (what train.py calls) hands ``routing.replay`` to the summary."""
    from omegaconf import OmegaConf

    from gspo_megatron.config.compose import compose
    from gspo_megatron.run.run_log import open_run_log

    overrides = [
        "routing.replay=rollout",
        "logging.tensorboard=false",
        "logging.progress=false",
        "logging.charts=false",
    ]
    cfg = OmegaConf.to_object(compose(overrides + ["logging.wandb=false"]))
    log = open_run_log(cfg, tmp_path, "")
    log.log_step(1, {"reward/mean": 0.5, "routing/rollout_vs_train_changed_frac": 0.0})
    assert "expert sets changed by an update: not measured under R3" in log.close()
