"""The LR scheduler's state goes into the checkpoint's trainer state, which resume loads with
``weights_only=True``: it must hold plain data only, whatever form the decay style came in."""

from __future__ import annotations

import io

import pytest
import torch

from gspo_megatron.policy.config import DecayStyle, OptimizerSection
from gspo_megatron.policy.optimizer import build_scheduler


@pytest.mark.parametrize("style", list(DecayStyle))
def test_scheduler_state_loads_weights_only(style):
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    section = OptimizerSection(decay_style=style, warmup_steps=2)
    scheduler = build_scheduler(optimizer, section, total_updates=10)
    scheduler.step(increment=3)
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["lr_decay_style"] == str(style) and type(state["lr_decay_style"]) is str
    assert state["num_steps"] == 3
