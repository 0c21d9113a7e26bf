"""What the policy's phases of one RL step hand back to the loop, on every rank.

    old = policy.old_log_probs(...)     -> OldPolicyResult
    update = policy.update(...)         -> UpdateResult
    routing = policy.finish_step(...)   -> RoutingResult

Each is frozen: no phase writes into another's result, and the loop builds what the next phase reads
(``contracts/batch.py:update_batches``) from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ClipFractions:
    """A step's clipped fractions (low + high side; the mean over its updates; NaN: nothing measured):
    what adaptive clipping (``algorithms/adaptive_clip.py``) steers by."""

    token: float  # loss/clip_frac_token
    seq: float  # loss/clip_frac_seq


@dataclass(frozen=True)
class OldPolicyResult:
    log_probs: torch.Tensor  # float [n, S-1]: pi_old of this rank's rows' targets
    metrics: dict[str, float]


@dataclass(frozen=True)
class UpdateResult:
    """The policy-update phase of one step."""

    metrics: dict[str, float]  # logged names: loss/*, entropy, grad_norm, nonfinite/*
    clip_fractions: ClipFractions  # what adaptive clipping steers by


@dataclass(frozen=True)
class RoutingResult:
    """The step's routing diagnostics, reduced over ranks: scalars for ``metrics.jsonl`` and one record
    per diagnostic kind for ``routing.jsonl`` (the same on every rank; the driver's run log writes them)."""

    metrics: dict[str, float]
    records: list[dict] = field(default_factory=list)
