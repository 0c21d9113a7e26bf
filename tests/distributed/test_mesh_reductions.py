"""``ParallelMesh``'s reductions by meaning on 4 gloo ranks, against values computed by hand.

dp2 x pp2: rows differ over DP, layers over PP. tp2 x cp2 (sequence parallel on): every rank holds other
tokens of the same rows and layers.
"""

from __future__ import annotations

import pytest

from gspo_megatron.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def reductions_worker(ctx, layout_kwargs: dict) -> dict:
    import torch

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.config import preset
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    layout = ParallelLayout(**layout_kwargs, world_size=4).validate(preset("tiny"))
    apply_cpu_bridges()
    mesh = initialize_parallel(layout)
    try:
        rank = mesh.rank
        rows = mesh.sum_over_rows(torch.tensor([float(mesh.dp_rank + 1)]))
        flags = mesh.any_over_tokens_and_stages(torch.tensor([1 if rank == 3 else 0], dtype=torch.int32))
        stage = mesh.from_last_stage(torch.tensor([float(mesh.pp_rank)]))
        obj = mesh.object_from_last_stage({"stage": mesh.pp_rank})
        return {
            "rank": rank,
            "dp_rank": mesh.dp_rank,
            "pp_rank": mesh.pp_rank,
            "rows": float(rows),
            "flag": int(flags),
            "stage": float(stage),
            "obj": obj,
            "row_parts": mesh.row_parts_group is not None,
            "other_rows": mesh.other_rows_group is not None,
            "token_groups": len(mesh.token_groups()),
        }
    finally:
        mesh.destroy()


def test_dp2_pp2_sums_rows_over_dp_and_takes_the_last_stages_values():
    ranks = run_distributed(reductions_worker, 4, dict(pp=2), timeout=300)
    assert [r["rows"] for r in ranks] == [3.0] * 4  # dp ranks 0 and 1 contribute 1 + 2
    assert [r["stage"] for r in ranks] == [1.0] * 4 and [r["obj"] for r in ranks] == [{"stage": 1}] * 4
    # OR over other tokens / other layers: only rank 3's pipeline (same DP rank, the other stage) sees it
    flagged = [r for r in ranks if r["flag"]]
    assert len(flagged) == 2 and {r["pp_rank"] for r in flagged} == {0, 1}
    assert len({r["dp_rank"] for r in flagged}) == 1 and any(r["rank"] == 3 for r in flagged)
    assert all(not r["row_parts"] and r["other_rows"] and r["token_groups"] == 1 for r in ranks)


def test_tp2_cp2_ors_over_every_rank_and_keeps_sums_per_rank():
    ranks = run_distributed(reductions_worker, 4, dict(tp=2, cp=2), timeout=300)
    assert [r["rows"] for r in ranks] == [1.0] * 4  # one DP rank: nothing to sum
    assert [r["flag"] for r in ranks] == [1] * 4  # CP x sequence-parallel TP spans the 4 ranks
    assert [r["stage"] for r in ranks] == [0.0] * 4 and [r["obj"] for r in ranks] == [{"stage": 0}] * 4
    assert all(r["row_parts"] and not r["other_rows"] and r["token_groups"] == 3 for r in ranks)
