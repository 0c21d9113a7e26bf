"""The adaptive clip controller: hand-computed steps, bounds, metric choice, config errors."""

import math

import pytest

from gspo_megatron.algorithms.adaptive_clip import AdaptiveClipController
from gspo_megatron.algorithms.config import AlgorithmConfig


def _controller(**overrides):
    cfg = AlgorithmConfig(adaptive_clip_target=0.1, adaptive_clip_rate=0.5, **overrides)
    cfg.validate()
    return AdaptiveClipController.from_config(cfg)


def test_steps_by_hand_widen_on_too_much_clipping_and_narrow_on_too_little():
    c = _controller()
    assert c.metric == "loss/clip_frac_seq" and c.eps == (3e-4, 4e-4)
    m = c.update(0.15)  # error +0.5: scale e^{0.25}
    assert (m["clip/eps_low"], m["clip/measured"], m["clip/target"]) == (3e-4, 0.15, 0.1)
    assert c.scale == pytest.approx(math.exp(0.25))
    c.update(0.0)  # error -1: scale e^{0.25 - 0.5}
    assert c.scale == pytest.approx(math.exp(-0.25))
    c.update(0.9)  # error clamped to +1
    assert c.scale == pytest.approx(math.exp(0.25))
    low, high = c.eps
    assert low == pytest.approx(3e-4 * math.exp(0.25)) and high / low == pytest.approx(4 / 3)


def test_bounds_hold_and_nan_leaves_eps_alone():
    c = _controller(adaptive_clip_max_scale=2.0, adaptive_clip_min_scale=0.5)
    for _ in range(20):
        c.update(1.0)
    assert c.scale == 2.0
    c.update(float("nan"))
    assert c.scale == 2.0
    for _ in range(20):
        c.update(0.0)
    assert c.scale == 0.5
    state = c.state_dict()
    fresh = _controller(adaptive_clip_max_scale=2.0, adaptive_clip_min_scale=0.5)
    fresh.load_state_dict(state)
    assert fresh.eps == c.eps


def test_grpo_reads_the_token_fraction_and_apply_leaves_the_config_untouched():
    cfg = AlgorithmConfig(loss="grpo", clip_low=0.2, clip_high=0.28, adaptive_clip_target=0.01)
    c = AdaptiveClipController.from_config(cfg)
    assert c.metric == "loss/clip_frac_token"
    c.update(0.02)
    applied = c.apply(cfg)
    assert applied.clip_low == pytest.approx(0.2 * math.exp(0.2)) and cfg.clip_low == 0.2
    assert AdaptiveClipController.from_config(AlgorithmConfig()) is None


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(adaptive_clip_target=1.5), "adaptive_clip_target must be in \\(0, 1\\)"),
        (dict(adaptive_clip_target=0.1, adaptive_clip_rate=0.0), "adaptive_clip_rate must be > 0"),
        (dict(adaptive_clip_target=0.1, adaptive_clip_min_scale=2.0), "0 < min_scale <= 1 <= max_scale"),
        (dict(adaptive_clip_target=0.1, loss="grpo", clip_low=0.3, clip_high=0.3), "lower adaptive_clip_max_scale"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        (AlgorithmConfig(**overrides)).validate()
