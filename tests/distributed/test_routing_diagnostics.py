"""RoutingDiagnostics (policy/routing/diagnostics.py): recorded routings in, reduced volatility out -- by hand.

One micro-batch of one row, 3 fed tokens (the last is padding), 2 MoE layers, top-2:

    old   layer 0: {0,1} {2,3} {0,1}     layer 1: {0,1} {0,1} {0,1}
    new   layer 0: {0,1} {2,0} {3,2}     layer 1: {1,0} {0,2} {1,2}

Token 2 is masked out. Token 0 keeps its sets; token 1 changes one expert in both layers, so
changed per layer = [1, 1] of 2 tokens, overlap = (2 + 1) / (2 * 2) per layer, changed in any layer
= 1 of 2. A second data-parallel rank whose routing did not move adds 2 unchanged tokens: merged
changed_frac_overall = 2 / (4 * 2), overlap_overall = (6 + 8) / (4 * 2 * 2), changed_any = 1 / 4.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.policy.routing.config import RoutingConfig
from gspo_megatron.policy.routing.plan import RoutingPlan
from gspo_megatron.policy.routing.replay import ReplayMode
from gspo_megatron.testing.distributed import run_distributed

OLD = [torch.tensor([[0, 1], [2, 3], [0, 1]]), torch.tensor([[0, 1], [0, 1], [0, 1]])]
NEW = [torch.tensor([[0, 1], [2, 0], [3, 2]]), torch.tensor([[1, 0], [0, 2], [1, 2]])]


def _update_diagnostics(mesh, turns: int = 0):
    """The "update" diagnostics of a two-update step on ``mesh`` and its one micro-batch: one row, 3 fed
    tokens, the last padding; ``turns``: diagnosed per turn (token 0 fed by turn 0, token 1 by turn 1)."""
    from gspo_megatron.policy.routing.diagnostics import RoutingDiagnostics

    plan = RoutingPlan(
        ReplayMode.none,
        engine_old_policy=False,
        updates=2,
        has_routers=True,
        diagnostics=RoutingConfig(kinds=["update"]),
        turns=turns,
    )
    diagnostics = RoutingDiagnostics(plan, mesh, 4)
    mb = MicroBatch(tokens=torch.ones(1, 3, dtype=torch.long), targets=torch.ones(1, 3, dtype=torch.long))
    mb.input_mask = torch.tensor([[1.0, 1.0, 0.0]])
    if turns:
        mb.input_turns = torch.tensor([[0, 1, -1]])
    return plan, diagnostics, mb


def _diagnose(ctx, turns: int = 0):
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    apply_cpu_bridges()
    mesh = initialize_parallel(ParallelLayout(world_size=ctx.world_size).validate())
    try:
        plan, diagnostics, mb = _update_diagnostics(mesh, turns)
        diagnostics.begin_step([mb])
        diagnostics.from_old_pass(4, [mb], lambda mb: [], [OLD], [OLD])
        assert plan.records_training_forward(update=1, step=4)  # the free measurement after step 1
        assert not plan.records_training_forward(update=0, step=4)
        after = NEW if ctx.rank == 0 else OLD  # rank 1's routing did not move
        diagnostics.from_training_forward([after], 0, [mb], None, step=4)
        result = diagnostics.finish_step(step=4)
        return result.metrics, result.records
    finally:
        mesh.destroy()


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.slow
def test_update_volatility_by_hand_merged_over_data_parallel_ranks(world_size):
    results = run_distributed(_diagnose, world_size)
    tokens = 2 * world_size
    expected = {
        "routing/update_changed_frac": 2 / (tokens * 2),
        "routing/update_overlap": (6 + 8 * (world_size - 1)) / (tokens * 2 * 2),
        "routing/update_experts_changed_per_slot": 2 / (tokens * 2 * 2),  # 2 of the slots' experts swapped
        "routing/update_changed_any_frac": 1 / tokens,
    }
    for rank_metrics, rank_records in results:  # every rank returns the merged numbers and records
        assert rank_metrics == pytest.approx(expected)
        assert rank_records == results[0][1]
    (record,) = results[0][1]
    assert record["step"] == 4 and record["kind"] == "update" and record["tokens"] == tokens
    assert record["changed_frac"] == pytest.approx([1 / tokens, 1 / tokens])
    # expert load of the new routing (layer 0 on rank 0: experts 0,1 | 2,0 -> counts 2,1,1,0 of 4)
    if world_size == 1:
        assert record["expert_load"][0] == pytest.approx([0.5, 0.25, 0.25, 0.0])


def _diagnose_per_turn(ctx):
    return _diagnose(ctx, turns=3)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.slow
def test_update_volatility_per_turn_by_hand_merged_over_data_parallel_ranks(world_size):
    """Token 0 (turn 0) kept its experts; token 1 (turn 1) changed one of two in both layers (rank 1: none);
    no token of turn 2. Per turn, the counts of its own tokens only; the whole as without turns."""
    results = run_distributed(_diagnose_per_turn, world_size)
    w = world_size
    expected = {
        "routing/update_changed_frac": 2 / (2 * w * 2),
        "routing/update_changed_frac/turn_0": 0.0,
        "routing/update_overlap/turn_0": 1.0,
        "routing/update_changed_frac/turn_1": 2 / (w * 2),
        "routing/update_overlap/turn_1": (2 + 4 * (w - 1)) / (w * 2 * 2),
        "routing/update_changed_any_frac/turn_1": 1 / w,
    }
    for rank_metrics, rank_records in results:
        assert {key: rank_metrics[key] for key in expected} == pytest.approx(expected)
        assert math.isnan(rank_metrics["routing/update_changed_frac/turn_2"])  # no token: unknown, not 0
        assert json.dumps(rank_records) == json.dumps(results[0][1])  # NaN != NaN: compared as written
    whole, *per_turn = results[0][1]
    assert "turn" not in whole and [r["turn"] for r in per_turn] == [0, 1, 2]
    assert [r["tokens"] for r in per_turn] == [w, w, 0] and whole["tokens"] == 2 * w


def _diagnose_on_two_stages(ctx):
    """pp2: stage 0 holds layer 0, stage 1 layer 1, of the same 2 real tokens. Token 0 changes in both
    layers, token 1 in neither: changed in any layer = 1 of 2 (per-stage counts would sum to 2)."""
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    apply_cpu_bridges()
    mesh = initialize_parallel(ParallelLayout(pp=2, world_size=2).validate())
    try:
        plan, diagnostics, mb = _update_diagnostics(mesh)
        old = [torch.tensor([[0, 1], [2, 3], [0, 1]])]  # this stage's one layer
        new = (
            [torch.tensor([[2, 3], [3, 2], [1, 2]])] if mesh.pp_rank == 0 else [torch.tensor([[0, 2], [2, 3], [0, 2]])]
        )
        diagnostics.begin_step([mb])
        diagnostics.from_old_pass(4, [mb], lambda mb: [], [old], [old])
        diagnostics.from_training_forward([new], 0, [mb], None, step=4)
        return diagnostics.finish_step(step=4).metrics
    finally:
        mesh.destroy()


@pytest.mark.slow
def test_changed_in_any_layer_is_formed_over_pipeline_stages_by_hand():
    """It was NaN (unknown) under pp > 1; the stages' per-token flags are OR-ed before the counts join."""
    for metrics in run_distributed(_diagnose_on_two_stages, 2):
        assert metrics["routing/update_changed_any_frac"] == 0.5
        # per layer: layer 0 changed token 0 (of 2), layer 1 changed token 0 as well
        assert metrics["routing/update_changed_frac"] == pytest.approx(2 / (2 * 2))
