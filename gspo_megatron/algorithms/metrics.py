"""Loss metrics as additive tensors: sums with counts, and mins/maxes, merged once per step.

Design decisions:
- A metrics dict is flat ``dict[str, Tensor]`` of 0-d tensors whose key suffix names how it combines
  across micro-batches and ranks: ``<name>/sum`` and ``<name>/count`` add, ``<name>/min`` takes the
  minimum, ``<name>/max`` the maximum. A mean is therefore ``sum / count`` computed once, after all
  micro-batches and ranks were combined -- averaging per-micro-batch means would weight small
  micro-batches too much. A plain dict pickles, stacks into one collective, and needs no class.
- Empty selections use the identity of their reduction (sum 0, count 0, min +inf, max -inf), so they
  merge correctly; ``finalize_metrics`` turns a zero count or an untouched extremum into NaN rather
  than inventing a number.
- Nothing here calls ``.item()``: values stay on device until the trainer logs them once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

SUM, COUNT, MIN, MAX = "/sum", "/count", "/min", "/max"
_SUFFIXES = (SUM, COUNT, MIN, MAX)


def reduction_of(key: str) -> str:
    """'sum', 'min' or 'max': how the metric entry ``key`` combines across micro-batches and ranks."""
    for suffix, op in ((SUM, "sum"), (COUNT, "sum"), (MIN, "min"), (MAX, "max")):
        if key.endswith(suffix):
            return op
    raise ValueError(f"metric key {key!r} has no reduction suffix; end it with one of {', '.join(_SUFFIXES)}")


def mean_entries(name: str, total: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
    """Entries for a mean metric: its sum and its count (divided only in ``finalize_metrics``)."""
    return {name + SUM: total.detach().float(), name + COUNT: count.detach().float()}


def extremum_entries(name: str, values: torch.Tensor, select: torch.Tensor) -> dict[str, torch.Tensor]:
    """Min and max of ``values`` over the positions where ``select`` is true (+inf / -inf if none)."""
    values = values.detach().float()
    return {
        name + MIN: torch.where(select, values, torch.inf).amin() if values.numel() else values.new_tensor(torch.inf),
        name + MAX: torch.where(select, values, -torch.inf).amax() if values.numel() else values.new_tensor(-torch.inf),
    }


def token_mean_metric(
    name: str,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Mean of a per-token quantity over valid tokens (e.g. the entropy from ``vocab_parallel_log_probs``).

    ``sequence_sum`` is the loss context's reducer (the CP all-reduce under context parallelism), so the
    sum and count cover whole sequences exactly like the loss does.
    """
    mask = response_mask.bool()
    reduce = sequence_sum if sequence_sum is not None else (lambda x: x.sum(-1))
    with torch.no_grad():
        total = reduce(torch.where(mask, values.detach().float(), 0.0)).sum()
        count = reduce(mask.float()).sum()
    return mean_entries(name, total, count)


def merge_metrics(
    accumulated: Mapping[str, torch.Tensor] | None, new: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Combine two metric dicts entry by entry (sum / min / max by suffix); ``accumulated`` may be None."""
    if accumulated is None:
        return {key: value.detach() for key, value in new.items()}
    if set(accumulated) != set(new):
        missing = sorted(set(accumulated) ^ set(new))
        raise ValueError(f"cannot merge metric dicts with different keys; differing keys: {missing}")
    merged = {}
    for key, value in accumulated.items():
        op = reduction_of(key)
        other = new[key].detach()
        if op == "sum":
            merged[key] = value + other
        elif op == "min":
            merged[key] = torch.minimum(value, other)
        else:
            merged[key] = torch.maximum(value, other)
    return merged


def finalize_metrics(metrics: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``name -> mean`` for every sum/count pair, ``name/min`` and ``name/max`` kept; NaN where empty."""
    out: dict[str, torch.Tensor] = {}
    for key, value in metrics.items():
        op = reduction_of(key)
        if key.endswith(SUM):
            name = key[: -len(SUM)]
            if name + COUNT not in metrics:
                raise ValueError(f"metric {name!r} has a sum but no {name + COUNT!r} entry")
            count = metrics[name + COUNT]
            out[name] = torch.where(count > 0, value / count.clamp_min(1e-30), torch.nan)
        elif op in ("min", "max"):
            out[key] = torch.where(torch.isfinite(value), value, torch.nan)
    return out
