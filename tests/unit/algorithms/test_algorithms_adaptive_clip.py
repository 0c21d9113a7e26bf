"""The adaptive clip controller: hand-computed steps, bounds, metric choice, config errors."""

import math

import pytest

from gspo_megatron.algorithms.adaptive_clip import AdaptiveClipController
from gspo_megatron.algorithms.config import AdaptiveClipConfig, AlgorithmConfig
from gspo_megatron.algorithms.losses import LossConfig, LossContext

GRPO = LossConfig(name="grpo", clip_low=0.2, clip_high=0.28)


def _controller(**overrides):
    cfg = AlgorithmConfig(adaptive_clip=AdaptiveClipConfig(target=0.1, rate=0.5, **overrides))
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
    c = _controller(max_scale=2.0, min_scale=0.5)
    for _ in range(20):
        assert c.update(1.0)["clip/held"] == 0.0
    assert c.scale == 2.0
    held = c.update(float("nan"))
    assert c.scale == 2.0 and held["clip/held"] == 1.0  # visible, not a silent no-op
    for _ in range(20):
        c.update(0.0)
    assert c.scale == 0.5
    state = c.state_dict()
    fresh = _controller(max_scale=2.0, min_scale=0.5)
    fresh.load_state_dict(state)
    assert fresh.eps == c.eps


def test_grpo_reads_the_token_fraction_and_the_scaled_eps_reach_the_loss_context():
    cfg = AlgorithmConfig(loss=GRPO, adaptive_clip=AdaptiveClipConfig(target=0.01))
    c = AdaptiveClipController.from_config(cfg)
    assert c.metric == "loss/clip_frac_token"
    c.update(0.02)
    ctx = LossContext(cfg.loss, clip=c.eps)
    assert ctx.clip_low == pytest.approx(0.2 * math.exp(0.2)) and cfg.loss.clip_low == 0.2
    assert LossContext(cfg.loss).clip_low == 0.2
    assert AdaptiveClipController.from_config(AlgorithmConfig()) is None


def test_grpo_at_the_largest_scale_builds_a_legal_loss_context():
    """Issue 29: GRPO's eps 0.2 x max_scale 4 = 0.8 is legal (floor 0.2), but re-validating the scaled
    eps as a config (0.8 * 4 >= 1) raised inside the update once the scale passed 1.25."""
    cfg = AlgorithmConfig(loss=GRPO, adaptive_clip=AdaptiveClipConfig(target=0.01))
    c = AdaptiveClipController.from_config(cfg)
    for _ in range(30):
        c.update(1.0)
    assert c.scale == 4.0
    ctx = LossContext(cfg.loss, clip=c.eps)
    assert (ctx.clip_low, ctx.clip_high) == pytest.approx((0.8, 1.12))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(target=1.5), "algorithm.adaptive_clip.target must be in \\(0, 1\\)"),
        (dict(target=0.1, rate=0.0), "algorithm.adaptive_clip.rate must be > 0"),
        (dict(target=0.1, min_scale=2.0), "0 < min_scale <= 1 <= max_scale"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveClipConfig(**overrides)


def test_a_scaled_floor_at_or_below_zero_is_refused_across_the_sections():
    loss = LossConfig(name="grpo", clip_low=0.3, clip_high=0.3)
    with pytest.raises(ValueError, match="algorithm.loss.clip_low \\* algorithm.adaptive_clip.max_scale = 1.2"):
        AlgorithmConfig(loss=loss, adaptive_clip=AdaptiveClipConfig(target=0.1))
