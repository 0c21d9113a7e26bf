"""Study E1's report (tools/study_reports/routing_shape_report.py) on hand-built runs: arms by shape and updates per
rollout, volatility per unit of update KL formed per step (steps without movement left out), the margin
histogram's median bin, the pre-registered verdicts at their thresholds, and a study of another shape (E1 on
Qwen3.5's) judged on its own shape and beside E1's arms."""

from pathlib import Path

import pytest

from gspo_megatron.core.run_dir import RunData
from study_reports.routing_shape_report import (
    margin_median_bin,
    reference_runs,
    study_files,
    summarize_arms,
    verdicts,
    volatility_per_kl,
)

EDGES = [0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0]


def make_run(
    layers: int, experts: int, k: int, updates: int, seed: int, changed: list[float], kl: list[float], share=0.1
):
    config = {
        "model": {"num_layers": layers, "num_experts": experts, "top_k": k},
        "trainer": {"seed": seed, "updates_per_rollout": updates},
    }
    metrics = [
        {
            "step": step,
            "routing/update_experts_changed_per_slot": c,
            "loss/approx_kl_k3_after_one_update": q,
            "ratio_decomp/token_var_share_routing": share,
        }
        for step, (c, q) in enumerate(zip(changed, kl, strict=True), start=1)
    ]
    routing = [
        {
            "step": step,
            "kind": "update",
            "changed_frac": [c] * layers,
            "topk_margin_edges": EDGES,
            "topk_margin_counts": [[1, 0, 3, 0, 0, 0, 0, 0, 0]] * layers,
            "topk_margin_mean": [0.002] * layers,
        }
        for step, c in enumerate(changed, start=1)
    ]
    return RunData(Path(f"run_{layers}_{updates}_{seed}"), "grpo", config, metrics, routing)


def test_volatility_per_kl_is_formed_per_step_and_skips_steps_that_did_not_move():
    run = make_run(6, 32, 4, 4, 1, changed=[0.02, 0.04, 0.5], kl=[0.01, 0.01, 0.0])
    assert volatility_per_kl(run) == (pytest.approx(3.0), 1)  # (2 + 4) / 2; the KL-0 step left out


def test_median_bin_is_the_bin_holding_the_middle_margin():
    assert margin_median_bin([1, 0, 3, 0, 0, 0, 0, 0, 0], EDGES) == 0.003
    assert margin_median_bin([2, 2, 0, 0, 0, 0, 0, 0, 0], EDGES) == 0.0
    assert margin_median_bin([0, 0, 0, 0, 0, 0, 0, 0, 5], EDGES) == 3.0


def _arms(paper_changed: tuple[float, float], paper_share: tuple[float, float]):
    runs = [
        make_run(48, 128, 8, 4, seed, [c, c], [0.01, 0.01], share)
        for seed, c, share in zip((1, 2), paper_changed, paper_share, strict=True)
    ]
    runs += [make_run(6, 32, 4, 4, seed, [0.01, 0.01], [0.01, 0.01]) for seed in (1, 2)]
    return summarize_arms(runs)


@pytest.mark.parametrize(
    ("changed", "expected"),
    [((0.09, 0.12), "reproduced"), ((0.01, 0.02), "not reproduced"), ((0.03, 0.07), "undetermined at this power")],
)
def test_volatility_verdict_at_the_preregistered_threshold(changed, expected):
    assert verdicts(_arms(changed, (0.1, 0.1)))[0]["verdict"] == expected


@pytest.mark.parametrize(
    ("share", "expected"),
    [((0.2, 0.3), "reproduced"), ((0.02, 0.05), "not reproduced"), ((0.1, 0.2), "undetermined at this power")],
)
def test_mechanism_verdict_at_the_preregistered_threshold(share, expected):
    assert verdicts(_arms((0.1, 0.1), share))[1]["verdict"] == expected


def test_shapes_compared_per_unit_of_kl_and_per_layer():
    arms = _arms((0.1, 0.12), (0.1, 0.1))
    deep = next(a for a in arms if a["shape"] == "48x128 top-8")
    assert deep["numbers"]["volatility_per_update_kl"]["values"] == pytest.approx([10.0, 12.0])
    assert deep["per_layer_mean_over_seeds"]["expert_sets_changed"] == pytest.approx([0.11] * 48)
    assert verdicts(arms)[2]["verdict"] == "larger at 48 x 128"  # 10 .. 12 vs 1 .. 1
    document, markdown = study_files([make_run(6, 32, 4, 1, 1, [0.01], [0.0])], manifests={})
    assert document["arms"][0]["numbers"]["volatility_per_update_kl"]["n"] == 0
    assert "| 6x32 top-4 | 1 | 1 |" in markdown


def test_means_are_exactly_rounded_so_every_python_regenerates_the_same_report():
    """Python 3.12's sum() of floats compensates and 3.11's does not: the stored E1 report regenerated with 384
    last-digit differences in the newest-stack leg before its means used math.fsum."""
    from study_reports.aggregate import Stat
    from study_reports.routing_shape_report import _mean

    assert _mean([0.1] * 10) == 0.1  # sum() on 3.11: 0.9999999999999999 / 10
    assert Stat.of([0.1] * 10, exact=True).mean == 0.1


def test_another_shape_is_judged_itself_and_beside_e1s_arms():
    """E1 on Qwen3.5's shape: no 48 x 128 arm; the verdicts judge 8x256 top-8, and its volatility per unit of
    update KL is compared with E1's 48 x 128 top-8 and 6 x 32 top-4 (the reference arms)."""
    qwen = summarize_arms([make_run(8, 256, 8, 4, seed, [0.03, 0.03], [0.01, 0.01], 0.02) for seed in (1, 2)])
    judged = verdicts(qwen, _arms((0.01, 0.01), (0.1, 0.1)))  # E1: 1 .. 1 per unit of KL at both shapes
    assert [v["verdict"] for v in judged] == [
        "not reproduced",
        "not reproduced",
        "larger at 8 x 256",
        "larger at 8 x 256",
    ]
    assert "at 8x256 top-8" in judged[0]["criterion"]
    assert set(judged[2]["ours"]) == {"8x256 top-8", "E1 48x128 top-8"}
    assert set(judged[3]["ours"]) == {"8x256 top-8", "E1 6x32 top-4"}
    assert len(verdicts(qwen)) == 2  # without E1's arms: no shape effect to judge


def test_each_shape_of_a_study_without_e1s_shape_is_judged_shallowest_first():
    runs = [make_run(40, 256, 8, 1, 1, [0.06], [0.01]), make_run(8, 256, 8, 1, 1, [0.03], [0.01])]
    judged = verdicts(summarize_arms(runs))
    assert [(v["criterion"].split(" at ")[1][:12], v["verdict"]) for v in judged] == [
        ("8x256 top-8 ", "not reproduced"),
        ("8x256 top-8,", "undetermined at this power"),  # no 4-updates arm: no routing share measured
        ("40x256 top-8", "reproduced"),
        ("40x256 top-8", "undetermined at this power"),
    ]


def test_e1s_runs_are_read_beside_another_shape_only(tmp_path):
    e1 = [make_run(48, 128, 8, 4, 1, [0.01], [0.01])]
    assert reference_runs(tmp_path / "e1_routing_shape", e1) == []  # E1 itself: nothing beside it
    with pytest.raises(FileNotFoundError, match=r"e1_routing_shape/store.json"):
        reference_runs(tmp_path / "e1_qwen35_shape", [make_run(8, 256, 8, 4, 1, [0.03], [0.01])])
