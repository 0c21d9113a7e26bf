"""``routing.jsonl``: one record per step and diagnostic kind, in the run-directory format (``core/run_dir.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gspo_megatron.core.run_dir import ROUTING_FILE, JsonlLog, to_jsonable
from gspo_megatron.policy.routing.config import validate_kind
from gspo_megatron.policy.routing.topk_margin import MARGIN_EDGES


def routing_record(
    step: int,
    kind: str,
    volatility=None,
    load=None,
    turn: int | None = None,
    margins=None,
) -> dict:
    """Build one routing.jsonl record from the objects in ``policy/routing/volatility.py``.

    ``volatility``: RoutingVolatility; ``load``: ExpertLoad (of the newer routing). Either may be
    None; step and kind are always present. ``turn``: the record covers only the positions that turn of
    multi-turn trajectories fed (``"turn"`` in the record); None: every position. ``margins``: TopkMargins
    (``policy/routing/topk_margin.py``) of the old routing, per layer: its histogram over ``MARGIN_EDGES``
    and its mean.
    """
    record: dict[str, Any] = {"step": int(step), "kind": validate_kind(kind)}
    if turn is not None:
        record["turn"] = int(turn)
    if volatility is not None:
        record.update(
            changed_frac=volatility.changed_frac,
            overlap=volatility.overlap,
            changed_frac_overall=volatility.changed_frac_overall,
            overlap_overall=volatility.overlap_overall,
            experts_changed_per_slot=volatility.experts_changed_per_slot,
            changed_any_frac=volatility.changed_any_frac,
            tokens=volatility.tokens,
        )
    if margins is not None:
        record.update(
            topk_margin_edges=list(MARGIN_EDGES),
            topk_margin_counts=margins.counts,
            topk_margin_mean=margins.mean,
        )
    if load is not None:
        record.update(expert_load=load.fraction, load_imbalance=load.imbalance, load_cv=load.coefficient_of_variation)
    return to_jsonable(record)


class RoutingLog(JsonlLog):
    """Writer of ``<run>/routing.jsonl``."""

    def __init__(self, run_dir: str | os.PathLike):
        super().__init__(Path(run_dir) / ROUTING_FILE)

    def log(self, step: int, kind: str, volatility=None, load=None) -> dict:
        record = routing_record(step, kind, volatility, load)
        self.append(record)
        return record
