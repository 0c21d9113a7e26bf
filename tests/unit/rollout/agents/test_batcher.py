"""The turn batcher's bookkeeping: whatever the order in which trajectories reach their awaits, ``run``
returns once every trajectory has ended (no engine is called when no trajectory asks for a turn)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gspo_megatron.rollout.agents.batcher import TurnBatcher


def run_bounded(batcher: TurnBatcher, trajectories: list) -> list:
    async def bounded() -> list:
        return await asyncio.wait_for(batcher.run(trajectories), 5.0)

    return asyncio.run(bounded())


@pytest.mark.parametrize(("before", "in_tool", "after"), list(itertools.product(range(3), repeat=3)))
def test_a_trajectory_ending_right_after_a_tool_ends_the_run(before, in_tool, after):
    # a trajectory that ended while the batcher yielded poked an event the batcher then cleared: with the
    # ending trajectory the last one, run() waited forever (1 tool call then the end, e.g.: 16 of 27 orders)
    batcher = TurnBatcher(engine=None, max_wait_s=0.05)  # type: ignore[arg-type] - no turn is asked for

    async def trajectory() -> str:
        for _ in range(before):
            await asyncio.sleep(0)
        with batcher.tool_call():
            for _ in range(in_tool):
                await asyncio.sleep(0)
        for _ in range(after):
            await asyncio.sleep(0)
        return "ended"

    assert run_bounded(batcher, [trajectory, trajectory]) == ["ended", "ended"]
    assert run_bounded(TurnBatcher(engine=None, max_wait_s=0.05), [trajectory]) == ["ended"]  # type: ignore[arg-type]
