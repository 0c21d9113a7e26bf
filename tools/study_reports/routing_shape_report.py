"""Study E1's report (issue 67): routing volatility, update KL, top-k margins and the routing share of the
ratio's variance per routing shape, judged by the criteria ``reports/e1_routing_shape/README.md`` fixed
before the runs.

Design decisions:
- An arm is (routing shape, updates per rollout); the shape is the model config's ``preset``
  (``conf/model/width64_*.yaml``), written "<layers>x<experts> top-<k>". A run is summarised by the mean
  over its steps of each number (every step measures one update); an arm by the mean and sample std over
  its seeds (``aggregate.Stat``).
- Volatility per unit of update KL is formed per step (experts changed per slot / that step's
  ``loss/approx_kl_k3_after_one_update``), then averaged: the step's volatility and its KL measure the same
  optimizer step on the same mini-batch. Steps whose KL is 0 (no movement) are left out and counted.
- Per-layer numbers come from the ``update`` records of routing.jsonl (turn-less ones): expert sets
  changed per layer and the top-k margin histogram per layer (``policy/routing/topk_margin.py``), whose
  median is read off the histogram's edges as the bin holding the middle margin.
- The verdicts apply the pre-registered thresholds (``VOLATILITY_REPRODUCED``, ``ROUTING_SHARE_AGAINST``) to
  the arm means and their seed ranges; the text says which rule decided.
- The judged shape is E1's 48 x 128 top-8 where the study has it, else each of the study's shapes (E1 on
  Qwen3.5's shape at two depths, ``reports/e1_qwen35_shape``). Such a study is read beside E1's arms
  (``reference_runs``: E1's own stored runs, summarised by the same code, not copied numbers): each shape's
  effect is judged against E1's 48 x 128 top-8 and 6 x 32 top-4 at 4 updates per rollout, and its report
  lists E1's arms under its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from gspo_megatron.core.run_dir import RunData
from study_reports.aggregate import Stat
from study_reports.store import load_store, reported_provenance
from study_reports.table_cells import stat_cell

PAPER_SHAPE = "48x128 top-8"
TODAY_SHAPE = "6x32 top-4"
PAPER_VOLATILITY = 0.10  # GSPO paper: ~10% of the activated experts change per gradient update (48 x 128 top-8)
VOLATILITY_REPRODUCED = 0.05  # pre-registered: within a factor 2 of the paper's ~10%
ROUTING_SHARE_AGAINST = 0.15  # pre-registered: a routing share of Var(log w) below this counts against
REFERENCE_STUDY = "e1_routing_shape"  # E1's study directory, beside the others under reports/
REFERENCE_SHAPES = (PAPER_SHAPE, TODAY_SHAPE)  # E1's arms another shape is read beside
# summary name -> metrics.jsonl key (mean over the run's steps)
STEP_KEYS = {
    "experts_changed_per_slot": "routing/update_experts_changed_per_slot",
    "expert_sets_changed": "routing/update_changed_frac",
    "changed_in_any_layer": "routing/update_changed_any_frac",
    "update_kl_after_one_update": "loss/approx_kl_k3_after_one_update",
    "update_kl_mean_over_updates": "loss/approx_kl_k3",
    "topk_margin_mean": "routing/topk_margin_mean",
    "topk_margin_below_0.01": "routing/topk_margin_below_0.01",
    "topk_margin_below_0.1": "routing/topk_margin_below_0.1",
    "routing_share_var_log_w": "ratio_decomp/token_var_share_routing",
    "routing_share_var_log_s": "ratio_decomp/seq_var_share_routing",
    "reward_mean": "reward/mean",
}


def shape_of(run: RunData) -> str:
    model = run.config.get("model", {})
    return f"{model['num_layers']}x{model['num_experts']} top-{model['top_k']}"


def arm_of(run: RunData) -> tuple[str, int]:
    return shape_of(run), int(run.config["trainer"]["updates_per_rollout"])


def _mean(values: Iterable[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else None


def volatility_per_kl(run: RunData) -> tuple[float | None, int]:
    """(mean over steps of experts changed per slot / update KL after one update, steps left out: KL 0)."""
    by_step = {m["step"]: m for m in run.metrics if "step" in m}
    ratios, skipped = [], 0
    for metrics in by_step.values():
        kl = metrics.get(STEP_KEYS["update_kl_after_one_update"])
        changed = metrics.get(STEP_KEYS["experts_changed_per_slot"])
        if kl is None or changed is None:
            continue
        if kl <= 0:
            skipped += 1
            continue
        ratios.append(changed / kl)
    return _mean(ratios), skipped


def margin_median_bin(counts: list[int], edges: list[float]) -> float:
    """The lower edge of the histogram bin that holds the middle margin."""
    total, seen = sum(counts), 0
    for count, edge in zip(counts, edges, strict=True):
        seen += count
        if 2 * seen >= total:
            return edge
    return edges[-1]


def per_layer(run: RunData) -> dict[str, list[float]]:
    """Per MoE layer, over the run's ``update`` records: expert sets changed (mean over steps), the top-k
    margin's mean and the lower edge of its median bin (the histograms summed over steps)."""
    records = run.routing_records("update")
    changed = [r["changed_frac"] for r in records if "changed_frac" in r]
    histograms = [r["topk_margin_counts"] for r in records if "topk_margin_counts" in r]
    out: dict[str, list[float]] = {}
    if changed:
        out["expert_sets_changed"] = [math.fsum(col) / len(col) for col in zip(*changed, strict=True)]
    if histograms:
        edges = records[0]["topk_margin_edges"]
        summed = [[sum(bins) for bins in zip(*layer, strict=True)] for layer in zip(*histograms, strict=True)]
        means = [r["topk_margin_mean"] for r in records if "topk_margin_mean" in r]
        out["topk_margin_mean"] = [math.fsum(col) / len(col) for col in zip(*means, strict=True)]
        out["topk_margin_median_bin"] = [margin_median_bin(layer, edges) for layer in summed]
    return out


def summarize_run(run: RunData) -> dict:
    summary: dict = {"run": run.path.name, "seed": run.config["trainer"]["seed"]}
    for name, key in STEP_KEYS.items():
        _, values = run.metric_series(key)
        summary[name] = _mean(values)
    summary["volatility_per_update_kl"], summary["steps_without_movement"] = volatility_per_kl(run)
    summary["per_layer"] = per_layer(run)
    return summary


def _stat(summaries: list[dict], name: str) -> dict:
    return Stat.of((s[name] for s in summaries), exact=True).to_dict()


def _layer_means(summaries: list[dict], name: str) -> list[float]:
    rows = [s["per_layer"][name] for s in summaries if name in s["per_layer"]]
    return [math.fsum(col) / len(col) for col in zip(*rows, strict=True)] if rows else []


def summarize_arms(runs: list[RunData]) -> list[dict]:
    """One entry per (shape, updates per rollout), in the stored runs' order of first appearance."""
    arms: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        arms.setdefault(arm_of(run), []).append(summarize_run(run))
    out = []
    for (shape, updates), summaries in arms.items():
        layers = {name: _layer_means(summaries, name) for name in ("expert_sets_changed", "topk_margin_mean")}
        out.append(
            {
                "shape": shape,
                "updates_per_rollout": updates,
                "seeds": [s["seed"] for s in summaries],
                "numbers": {name: _stat(summaries, name) for name in [*STEP_KEYS, "volatility_per_update_kl"]},
                "per_layer_mean_over_seeds": layers,
                "runs": summaries,
            }
        )
    return out


def _range(stat: dict) -> tuple[float, float] | None:
    values = stat["values"]
    return (min(values), max(values)) if values else None


def _threshold_verdict(stat: dict, threshold: float, above: str, below: str) -> tuple[str, str]:
    """("reproduced" | "not reproduced" | "undetermined at this power", the rule that decided)."""
    spread = _range(stat)
    if spread is None:
        return "undetermined at this power", "no run measured it"
    low, high = spread
    if low >= threshold:
        return above, f"every seed >= {threshold:g} (seeds {low:.4g} .. {high:.4g})"
    if high < threshold:
        return below, f"every seed < {threshold:g} (seeds {low:.4g} .. {high:.4g})"
    return "undetermined at this power", f"the seeds straddle {threshold:g} ({low:.4g} .. {high:.4g})"


def judged_shapes(arms: list[dict]) -> list[str]:
    """E1's 48 x 128 top-8 where the study has it, else every shape of the study, shallowest first."""
    shapes = {a["shape"] for a in arms}
    if PAPER_SHAPE in shapes:
        return [PAPER_SHAPE]
    return sorted(shapes, key=lambda shape: (int(shape.split("x")[0]), shape))


def _layers_by_experts(shape: str) -> str:
    """'48x128 top-8' -> '48 x 128'."""
    return shape.split(" ")[0].replace("x", " x ")


def _shape_effect(claim: str, paper: str, deep: dict, other: dict, other_label: str) -> dict:
    """Volatility per unit of update KL, ``deep`` against ``other`` (4 updates per rollout): by seed ranges."""
    a = _range(deep["numbers"]["volatility_per_update_kl"])
    b = _range(other["numbers"]["volatility_per_update_kl"])
    at = _layers_by_experts(deep["shape"])
    if a is None or b is None:
        verdict, rule = "undetermined at this power", "a shape has no step with update KL > 0"
    elif a[0] > b[1]:
        verdict, rule = f"larger at {at}", f"seed ranges {a} vs {b} do not overlap"
    elif a[1] < b[0]:
        verdict, rule = f"smaller at {at}", f"seed ranges {a} vs {b} do not overlap"
    else:
        verdict, rule = "no difference at this power", f"seed ranges {a} vs {b} overlap"
    return {
        "claim": claim,
        "paper": paper,
        "ours": {
            deep["shape"]: deep["numbers"]["volatility_per_update_kl"],
            other_label: other["numbers"]["volatility_per_update_kl"],
        },
        "criterion": "experts changed per slot / update KL after one update, 4 updates per rollout: "
        "seed ranges that do not overlap",
        "verdict": verdict,
        "rule": rule,
    }


def verdicts(arms: list[dict], reference_arms: list[dict] | None = None) -> list[dict]:
    """The pre-registered verdicts on each judged shape (``judged_shapes``); ``reference_arms``: E1's arms, for a
    study of other shapes (their shape effect is judged against E1's 48 x 128 top-8 and 6 x 32 top-4)."""
    return [v for shape in judged_shapes(arms) for v in _shape_verdicts(shape, arms, reference_arms)]


def _shape_verdicts(shape: str, arms: list[dict], reference_arms: list[dict] | None) -> list[dict]:
    by_arm = {(a["shape"], a["updates_per_rollout"]): a for a in arms}
    judged = [a for a in arms if a["shape"] == shape]
    out = []
    changed = Stat.of(
        (v for a in judged for v in a["numbers"]["experts_changed_per_slot"]["values"]), exact=True
    ).to_dict()
    verdict, rule = _threshold_verdict(changed, VOLATILITY_REPRODUCED, "reproduced", "not reproduced")
    out.append(
        {
            "claim": f"~10% of the experts change per gradient update ({_layers_by_experts(shape)} {shape.split()[1]})",
            "paper": PAPER_VOLATILITY,
            "ours": changed,
            "criterion": f"experts changed per slot per update >= {VOLATILITY_REPRODUCED:g} at {shape} "
            "(1 and 4 updates per rollout pooled)",
            "verdict": verdict,
            "rule": rule,
        }
    )
    share = by_arm.get((shape, 4), {}).get("numbers", {}).get("routing_share_var_log_w")
    verdict, rule = _threshold_verdict(
        share or Stat.of([], exact=True).to_dict(), ROUTING_SHARE_AGAINST, "reproduced", "not reproduced"
    )
    out.append(
        {
            "claim": "expert volatility makes the token ratios fluctuate (the routing part of Var(log w))",
            "paper": "argued, not measured",
            "ours": share,
            "criterion": f"routing share of Var(log w) >= {ROUTING_SHARE_AGAINST:g} at {shape}, "
            "4 updates per rollout; below it counts against the mechanism",
            "verdict": verdict,
            "rule": rule,
        }
    )
    deep = by_arm.get((shape, 4))
    today = by_arm.get((TODAY_SHAPE, 4))
    if deep and today and shape == PAPER_SHAPE:
        claim = "the paper's routing shape changes more experts per unit of policy movement"
        out.append(_shape_effect(claim, "implied (fine-grained experts, deep)", deep, today, TODAY_SHAPE))
    if deep is None or shape == PAPER_SHAPE:
        return out
    reference = {(a["shape"], a["updates_per_rollout"]): a for a in reference_arms or []}
    for other_shape in REFERENCE_SHAPES:
        other = reference.get((other_shape, 4))
        if other:
            claim = f"the {shape} shape changes more experts per unit of policy movement than E1's {other_shape}"
            out.append(_shape_effect(claim, "implied (more, finer experts)", deep, other, f"E1 {other_shape}"))
    return out


def _layer_span(values: list[float]) -> str:
    if not values:
        return "--"
    ordered = sorted(values)
    return f"{ordered[0]:.3g} / {ordered[len(ordered) // 2]:.3g} / {ordered[-1]:.3g}"


MARKDOWN_COLUMNS = (
    ("experts changed / slot", "experts_changed_per_slot"),
    ("expert sets changed", "expert_sets_changed"),
    ("changed in >= 1 layer", "changed_in_any_layer"),
    ("update KL (after 1 update)", "update_kl_after_one_update"),
    ("experts changed / update KL", "volatility_per_update_kl"),
    ("margin mean", "topk_margin_mean"),
    ("margin < 0.01", "topk_margin_below_0.01"),
    ("routing share Var(log w)", "routing_share_var_log_w"),
    ("routing share Var(log s)", "routing_share_var_log_s"),
    ("reward", "reward_mean"),
)


def _arm_rows(arms: list[dict], label: str = "") -> list[str]:
    rows = []
    for arm in arms:
        cells = [label + arm["shape"], str(arm["updates_per_rollout"]), str(len(arm["seeds"]))]
        cells += [stat_cell(arm["numbers"][key]) for _, key in MARKDOWN_COLUMNS]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def render_markdown(arms: list[dict], judged: list[dict], reference_arms: list[dict] | None = None) -> str:
    shapes = judged_shapes(arms)
    title = (
        "# E1: the GSPO paper's routing shape at tiny width"
        if shapes == [PAPER_SHAPE]
        else f"# E1 on the routing shapes {', '.join(shapes)} at tiny width (beside E1's arms)"
    )
    lines = [title, "", "## Verdicts (criteria fixed in README.md)", ""]
    lines += ["| claim | paper | criterion | verdict | rule |", "|---|---|---|---|---|"]
    for v in judged:
        lines.append(f"| {v['claim']} | {v['paper']} | {v['criterion']} | **{v['verdict']}** | {v['rule']} |")
    lines += ["", "## Per arm (mean ± sample std over seeds; each run the mean over its steps)", ""]
    header = ["shape", "updates / rollout", "seeds", *(name for name, _ in MARKDOWN_COLUMNS)]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += _arm_rows(arms) + _arm_rows(reference_arms or [], "E1 ")
    lines += ["", "## Per layer (min / median / max over the MoE layers; mean over seeds and steps)", ""]
    lines += ["| shape | updates / rollout | expert sets changed | top-k margin mean |", "|---|---|---|---|"]
    for label, shown in (("", arms), ("E1 ", reference_arms or [])):
        for arm in shown:
            layers = arm["per_layer_mean_over_seeds"]
            lines.append(
                f"| {label}{arm['shape']} | {arm['updates_per_rollout']} | "
                f"{_layer_span(layers['expert_sets_changed'])} | {_layer_span(layers['topk_margin_mean'])} |"
            )
    return "\n".join(lines) + "\n"


def reference_runs(study_dir: Path, runs: list[RunData]) -> list[RunData]:
    """E1's stored runs of ``REFERENCE_SHAPES`` when ``runs`` lack E1's 48 x 128 top-8 (a study of another
    shape, read beside E1), else none. E1's store is ``reports/e1_routing_shape``, beside ``study_dir``."""
    if any(shape_of(run) == PAPER_SHAPE for run in runs):
        return []
    reference_dir = study_dir.resolve().parent / REFERENCE_STUDY
    if not (reference_dir / "store.json").is_file():
        raise FileNotFoundError(
            f"{study_dir}: a routing_shape_study without {PAPER_SHAPE} is read beside E1's stored runs, "
            f"expected at {reference_dir}/store.json; restore reports/{REFERENCE_STUDY} from the repository"
        )
    return [run for run in load_store(reference_dir).runs if shape_of(run) in REFERENCE_SHAPES]


def study_files(runs: list[RunData], manifests: dict, reference: list[RunData] | None = None) -> tuple[dict, str]:
    """(report.json's document, report.md's text) of the stored runs; ``reference``: E1's runs to read beside
    them (``reference_runs``)."""
    arms = summarize_arms(runs)
    reference_arms = summarize_arms(reference) if reference else []
    judged = verdicts(arms, reference_arms)
    provenance = reported_provenance(manifests)
    document: dict = {"verdicts": judged, "arms": arms, "runs": provenance}
    if reference_arms:
        document["reference"] = {
            "study": f"reports/{REFERENCE_STUDY}",
            "arms": [
                {key: arm[key] for key in ("shape", "updates_per_rollout", "seeds", "numbers")}
                for arm in reference_arms
            ],
        }
    return document, render_markdown(arms, judged, reference_arms)
