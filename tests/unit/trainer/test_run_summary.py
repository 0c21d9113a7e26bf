"""The run summary printed at the end of a job: hand-built histories, checked line by line."""

from __future__ import annotations

from gspo_megatron.trainer.run_log import summary_text


def _step(step: int, reward: float, **extra) -> dict:
    clip = {"loss/clip_frac_seq": 0.05, "loss/clip_frac_token": 0.05}
    return {"step": step, "reward/mean": reward, "response/length_mean": 1.0, **clip, **extra}


def test_reward_windows_are_the_first_and_last_fifth():
    history = [_step(i + 1, float(i)) for i in range(10)]  # first fifth: 0, 1; last fifth: 8, 9
    text = summary_text(history, wall_s=30.0, plot=None)
    assert "10 steps in 0.5 min" in text
    assert "first 20%: 0.500   last 20%: 8.500" in text


def test_one_token_answers_print_no_nan_for_the_length_bucket():
    """The main job's answers are one token: no 5-16-token bucket exists, and the summary says so."""
    history = [_step(i + 1, 0.5, **{"loss/ratio_token_seq_gap": 0.0}) for i in range(5)]
    text = summary_text(history, wall_s=6.0, plot=None)
    assert "nan" not in text
    assert "mean |w_t - s_i| = 0 (no responses of 5-16 tokens, so no spread by length)" in text


def test_the_length_bucket_spreads_are_printed_when_measured():
    extra = {
        "loss/ratio_token_seq_gap": 0.02,
        "loss/ratio_var_token/len_5_16": 0.04,
        "loss/ratio_var_seq/len_5_16": 0.01,
    }
    history = [_step(i + 1, 0.5, **extra) for i in range(5)]
    text = summary_text(history, wall_s=6.0, plot=None)
    assert "mean |w_t - s_i| = 0.02 (token ratio spread E[(w-1)^2] 0.04 vs sequence 0.01 at 5-16 tokens)" in text
