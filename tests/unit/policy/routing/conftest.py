"""Fixtures shared by the routing tests."""

import pytest
from megatron.core.transformer.moe.router_replay import RouterReplay


@pytest.fixture
def instances():
    """Two of megatron's RouterReplay instances, removed from its global list afterwards."""
    before = len(RouterReplay.global_router_replay_instances)
    made = [RouterReplay() for _ in range(2)]
    yield made
    del RouterReplay.global_router_replay_instances[before:]
