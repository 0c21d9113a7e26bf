"""The weight sync's plan per sender: each pipeline stage's bytes over its own link, the stages in turn."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import planning
from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.models.hf_shapes import hf_shapes
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.testing.model_fixtures import tiny_test_config
from planning.comm import weight_sync_plan


def _bytes(cfg, names) -> int:
    return sum(math.prod(hf_shapes(cfg)[name]) for name in names)  # width 1


def test_each_stage_sender_carries_its_own_units_and_the_driver_path_adds_the_pipeline_hop():
    cfg = tiny_test_config()  # 2 layers: pp=2 puts one on each stage
    layout = ParallelLayout(pp=2, world_size=2).validate(cfg)
    names = list(hf_shapes(cfg))
    stage0 = [n for n in names if n.startswith("model.layers.0.") or n == "model.embed_tokens.weight"]
    stage1 = [n for n in names if n not in stage0]
    assert "lm_head.weight" in stage1 and "model.norm.weight" in stage1
    per_stage = weight_sync_plan(cfg, 1 << 30, 1.0, width=1, layout=layout, senders="per_stage")
    assert per_stage.sender_seconds == (_bytes(cfg, stage0), _bytes(cfg, stage1))  # 1 byte/s
    assert per_stage.seconds == per_stage.bytes == _bytes(cfg, names)  # turns: the sum
    assert per_stage.pipeline_hop_seconds == 0 and per_stage.buckets == 2  # one bucket per sender
    driver = weight_sync_plan(cfg, 1 << 30, 1.0, width=1, layout=layout, senders="driver")
    assert driver.sender_seconds == (_bytes(cfg, names),) and driver.buckets == 1
    assert driver.pipeline_hop_seconds == _bytes(cfg, stage1)  # stage 1's half into the driver first
    assert driver.seconds == _bytes(cfg, names) + _bytes(cfg, stage1)
    assert "2 pipeline-stage senders" in per_stage.describe() and "driver alone" in driver.describe()


@pytest.mark.parametrize("model, layout", [("qwen3_235b_a22b", dict(tp=4, pp=4, cp=2, ep=16, etp=1))])
def test_at_235b_pp4_each_sender_sends_about_a_quarter(model, layout):
    """The issue's bound: each sender at most ~1/pp of the driver's 13.4 s; the sync itself stays the model
    over one link (the servers take one group's update at a time), which ``describe`` says."""
    cfg = MoEModelConfig.from_hf_config_file(Path(planning.__file__).parent / "hf_configs" / f"{model}.json")
    pl = ParallelLayout(**layout, world_size=64, last_stage_layers=22).validate(cfg)
    link = 35e9
    plan = weight_sync_plan(cfg, 512 << 20, link, layout=pl)
    alone = plan.bytes / link
    assert len(plan.sender_seconds) == 4 and max(plan.sender_seconds) <= 1.05 * alone / 4
    assert plan.seconds == pytest.approx(alone)
    assert "one distributed update at a time per server" in plan.describe()
