"""Routing diagnostics as pure tensor functions: activation volatility, expert load, router entropy/KL.

Inputs follow one layout everywhere:
- top-k expert indices: integer ``[N tokens, L layers, k]`` (megatron's router top-k, or SGLang's
  ``routed_experts`` restricted to the MoE layers);
- router probabilities: float ``[N, L, E]`` (softmax over all E experts, before top-k);
- ``token_mask``: optional bool ``[N]`` selecting the valid tokens (padding, prompt, sampling).

Design decisions:
- Top-k rows are *sets*: the order in which a router lists its k experts carries no meaning, so
  ``[3, 7]`` and ``[7, 3]`` are the same routing. Rows are assumed to hold k distinct experts (true of
  any top-k); the intersection size is then a count of pairwise matches.
- Results that must be combined over micro-batches and data-parallel ranks are kept as integer sums
  and counts (``RoutingVolatility``, ``ExpertLoad``), so ``merge`` and ``all_reduce`` give exactly
  the numbers one big batch would (fractions are formed only at the end, never averaged).
- The intersection is found one column of ``b`` at a time (k passes over ``[N, L, k]`` bools)
  instead of materialising ``[N, L, k, k]``: 64k tokens x 48 layers x 8 needs ~25 MB of scratch.
- Results stay tensors on the input's device until the caller logs them; ``routing_volatility``
  never syncs with the host (``expert_load``'s index range check does,
  once per call). Cost, measured on 1 shared CPU thread: 64k tokens x 48 layers x k=8 in ~0.35-0.65 s.

Definitions (activation volatility as measured in GSPO, arXiv 2507.18071, section on MoE training):
    changed_{n,l} = [ set(a_{n,l}) != set(b_{n,l}) ]
    overlap_{n,l} = |set(a_{n,l}) cap set(b_{n,l})| / k
    changed_any_n = OR_l changed_{n,l}   (token-level: the experts differ in at least one layer)
Volatility is reported two ways, named so, because they differ by up to ~k times:
- **expert sets changed** (``changed_frac_overall``, ``routing/<kind>_changed_frac``): the fraction of
  (token, layer) pairs whose top-k set changed -- a whole set counts as changed when any one member differs;
- **experts changed per slot** (``experts_changed_per_slot``, ``routing/<kind>_experts_changed_per_slot``):
  the fraction of the (token, layer, slot) assignments whose expert is not in the other set,
  1 - overlap = sum_{n,l} (k - |A cap B|) / (N L k). One of k experts swapped in every pair gives 100% of
  expert sets changed but 1/k of the experts per slot.
Per-layer fractions understate what a token sees: with p changed per layer, independent over L
layers, 1 - (1 - p)^L of the tokens differ somewhere (Megatron-LM's R3 work: ~10% per layer
compounding into ~94% of tokens). ``changed_any_frac`` is that token-level number, measured.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _check_topk(a: torch.Tensor, name: str) -> None:
    if a.dim() != 3:
        raise ValueError(f"{name} must be top-k expert indices [tokens, layers, k], got shape {tuple(a.shape)}")
    if a.dtype.is_floating_point or a.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer expert indices, got dtype {a.dtype}")


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    _check_topk(a, "a")
    _check_topk(b, "b")
    if a.shape != b.shape:
        raise ValueError(
            f"top-k tensors must describe the same tokens/layers/k, got {tuple(a.shape)} vs {tuple(b.shape)}"
        )


def _check_mask(token_mask: torch.Tensor | None, num_tokens: int) -> None:
    if token_mask is None:
        return
    if token_mask.dtype != torch.bool or token_mask.shape != (num_tokens,):
        raise ValueError(
            f"token_mask must be bool [{num_tokens}] (one entry per token), "
            f"got {token_mask.dtype} {tuple(token_mask.shape)}"
        )


def _select(x: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    return x if token_mask is None else x[token_mask]


def _intersection_size(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|set(a_{n,l}) cap set(b_{n,l})| as int64 [N, L], assuming distinct experts within a row."""
    # found[n, l, i] = a's i-th expert appears anywhere in b's row; OR-accumulated one column of b at
    # a time so no [N, L, k, k] tensor exists, then a single reduction (3x faster than k sums).
    found = a == b[..., :1]
    for j in range(1, b.shape[-1]):
        found |= a == b[..., j : j + 1]
    return found.sum(dim=-1)


def topk_set_changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [N, L]: True where the top-k expert *set* differs (the order within a row is ignored)."""
    _check_pair(a, b)
    return _intersection_size(a, b) != a.shape[-1]


def topk_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 [N, L]: |A cap B| / k per token and layer (1 = same experts, 0 = disjoint)."""
    _check_pair(a, b)
    return _intersection_size(a, b).float() / a.shape[-1]


@dataclass
class RoutingVolatility:
    """Sums and counts for the volatility between two routings; merge before forming fractions."""

    changed_count: torch.Tensor  # int64 [L]: tokens whose top-k set changed, per layer
    intersection_count: torch.Tensor  # int64 [L]: sum over tokens of |A cap B|, per layer
    tokens: torch.Tensor  # int64 []: tokens compared (the same for every layer)
    top_k: int
    # int64 []: tokens whose set changed in at least one of these layers. Pipeline stages hold
    # disjoint layers, and an OR over stages cannot be formed from per-stage counts: it is formed from
    # ``changed_any_tokens`` (``or_over_stages``) before the counts of the stages are joined.
    changed_any_count: torch.Tensor
    # bool [N]: per compared token, in order, whether its set changed in one of these layers (the
    # per-token form of changed_any_count, kept until the stages' flags are OR-ed; None once reduced)
    changed_any_tokens: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.changed_count.shape[0]

    @property
    def changed_frac(self) -> torch.Tensor:
        """float64 [L]: fraction of tokens whose expert set changed (NaN when no tokens)."""
        return self.changed_count.double() / self.tokens.double()

    @property
    def overlap(self) -> torch.Tensor:
        """float64 [L]: mean |A cap B| / k."""
        return self.intersection_count.double() / (self.tokens.double() * self.top_k)

    @property
    def changed_frac_overall(self) -> torch.Tensor:
        """float64 []: fraction of (token, layer) pairs whose expert set changed."""
        return self.changed_count.sum().double() / (self.tokens.double() * self.num_layers)

    @property
    def changed_any_frac(self) -> torch.Tensor:
        """float64 []: fraction of tokens whose expert set differs in at least one layer (NaN: unknown,
        a negative count, as after gathering pipeline stages)."""
        frac = self.changed_any_count.double() / self.tokens.double()
        return torch.where(self.changed_any_count < 0, torch.full_like(frac, float("nan")), frac)

    @property
    def overlap_overall(self) -> torch.Tensor:
        return self.intersection_count.sum().double() / (self.tokens.double() * self.num_layers * self.top_k)

    @property
    def experts_changed_per_slot(self) -> torch.Tensor:
        """float64 []: fraction of the (token, layer, slot) assignments whose expert is not in the other
        routing's set, sum (k - |A cap B|) / (N L k) = 1 - overlap_overall (formed from the integer counts)."""
        slots = self.tokens * self.num_layers * self.top_k
        return (slots - self.intersection_count.sum()).double() / slots.double()

    def merge(self, other: RoutingVolatility) -> RoutingVolatility:
        """The volatility of the union of both token sets (exact: sums of counts)."""
        if (self.num_layers, self.top_k) != (other.num_layers, other.top_k):
            raise ValueError(
                "cannot merge volatilities of different shapes: "
                f"(layers={self.num_layers}, k={self.top_k}) vs (layers={other.num_layers}, k={other.top_k})"
            )
        flags = None
        if self.changed_any_tokens is not None and other.changed_any_tokens is not None:
            flags = torch.cat([self.changed_any_tokens, other.changed_any_tokens])
        return RoutingVolatility(
            self.changed_count + other.changed_count,
            self.intersection_count + other.intersection_count,
            self.tokens + other.tokens,
            self.top_k,
            self.changed_any_count + other.changed_any_count,
            flags,
        )

    def to(self, device) -> RoutingVolatility:
        flags = self.changed_any_tokens
        return RoutingVolatility(
            self.changed_count.to(device),
            self.intersection_count.to(device),
            self.tokens.to(device),
            self.top_k,
            self.changed_any_count.to(device),
            flags.to(device) if flags is not None else None,
        )

    def or_over_stages(self, group) -> RoutingVolatility:
        """The same tokens' "changed in any layer" over every pipeline stage of ``group``: the OR of the
        stages' per-token flags (each stage compares the same micro-batches' tokens in the same order)."""
        if self.changed_any_tokens is None:
            raise ValueError("or_over_stages needs the per-token flags (changed_any_tokens)")
        flags = self.changed_any_tokens.to(torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        count = flags.sum().to(torch.int64)
        return RoutingVolatility(self.changed_count, self.intersection_count, self.tokens, self.top_k, count)

    @staticmethod
    def concat_layers(parts: list[RoutingVolatility]) -> RoutingVolatility:
        """Pipeline stages' volatilities of the same tokens over disjoint layers, in stage order. Their
        "changed in any layer" counts agree once formed over all stages (``or_over_stages``); counts that
        disagree were not, and are unknown (-1)."""
        counts = {int(p.changed_any_count) for p in parts}
        any_count = counts.pop() if len(counts) == 1 else -1
        return RoutingVolatility(
            torch.cat([p.changed_count for p in parts]),
            torch.cat([p.intersection_count for p in parts]),
            parts[0].tokens,
            parts[0].top_k,
            torch.tensor(any_count, dtype=torch.int64),
        )

    @staticmethod
    def merge_all(parts: Iterable[RoutingVolatility]) -> RoutingVolatility:
        parts = list(parts)
        if not parts:
            raise ValueError("merge_all needs at least one RoutingVolatility")
        total = parts[0]
        for part in parts[1:]:
            total = total.merge(part)
        return total


def routing_volatility(a: torch.Tensor, b: torch.Tensor, token_mask: torch.Tensor | None = None) -> RoutingVolatility:
    """Compare two routings of the same tokens (e.g. before vs after an update) over the masked tokens."""
    _check_pair(a, b)
    _check_mask(token_mask, a.shape[0])
    a, b = _select(a, token_mask), _select(b, token_mask)
    top_k = a.shape[-1]
    intersection = _intersection_size(a, b)  # [N', L]
    changed = intersection != top_k  # [N', L]
    return RoutingVolatility(
        changed_count=changed.sum(dim=0),
        intersection_count=intersection.sum(dim=0),
        tokens=torch.tensor(a.shape[0], dtype=torch.int64, device=a.device),
        top_k=top_k,
        changed_any_count=changed.any(dim=1).sum(),
        changed_any_tokens=changed.any(dim=1),
    )


@dataclass
class ExpertLoad:
    """Expert assignment counts per layer; mergeable like ``RoutingVolatility``."""

    counts: torch.Tensor  # int64 [L, E]: (token, slot) assignments to each expert
    tokens: torch.Tensor  # int64 []
    top_k: int

    @property
    def fraction(self) -> torch.Tensor:
        """float64 [L, E]: share of the layer's assignments each expert received (rows sum to 1)."""
        return self.counts.double() / (self.tokens.double() * self.top_k)

    @property
    def imbalance(self) -> torch.Tensor:
        """float64 [L]: max_e load / mean_e load (1 = perfectly balanced, E = one expert takes all)."""
        counts = self.counts.double()
        return counts.max(dim=-1).values / counts.mean(dim=-1)

    @property
    def coefficient_of_variation(self) -> torch.Tensor:
        """float64 [L]: std_e load / mean_e load (population std over experts)."""
        counts = self.counts.double()
        return counts.std(dim=-1, unbiased=False) / counts.mean(dim=-1)

    def merge(self, other: ExpertLoad) -> ExpertLoad:
        if self.counts.shape != other.counts.shape or self.top_k != other.top_k:
            raise ValueError(
                f"cannot merge expert loads of different shapes: {tuple(self.counts.shape)}, k={self.top_k} "
                f"vs {tuple(other.counts.shape)}, k={other.top_k}"
            )
        return ExpertLoad(self.counts + other.counts, self.tokens + other.tokens, self.top_k)

    def to(self, device) -> ExpertLoad:
        return ExpertLoad(self.counts.to(device), self.tokens.to(device), self.top_k)

    @staticmethod
    def concat_layers(parts: list[ExpertLoad]) -> ExpertLoad:
        """Pipeline stages' loads of the same tokens over disjoint layers, in stage order."""
        return ExpertLoad(torch.cat([p.counts for p in parts]), parts[0].tokens, parts[0].top_k)


def expert_load(topk: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None) -> ExpertLoad:
    """Count how often each expert is chosen per layer over the masked tokens."""
    _check_topk(topk, "topk")
    _check_mask(token_mask, topk.shape[0])
    topk = _select(topk, token_mask).long()
    num_layers = topk.shape[1]
    if topk.numel() and (topk.min() < 0 or topk.max() >= num_experts):
        raise ValueError(
            f"expert indices must lie in [0, {num_experts}), got range "
            f"[{int(topk.min())}, {int(topk.max())}]; is num_experts right?"
        )
    # One bincount over all layers: expert e of layer l lands in bin l * E + e.
    layer_offset = torch.arange(num_layers, device=topk.device).view(1, num_layers, 1) * num_experts
    counts = torch.bincount((topk + layer_offset).flatten(), minlength=num_layers * num_experts)
    return ExpertLoad(
        counts=counts.view(num_layers, num_experts),
        tokens=torch.tensor(topk.shape[0], dtype=torch.int64, device=topk.device),
        top_k=topk.shape[-1],
    )


def _all_reduce_sum(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Sum int64 tensors over ``group`` in one collective; returns new tensors, inputs untouched."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].view_as(t))
        start += t.numel()
    return out


def all_reduce_volatility(volatility: RoutingVolatility, group=None) -> RoutingVolatility:
    """Merge the volatility of every rank in ``group`` (all ranks must pass the same L and k)."""
    changed, intersection, tokens, changed_any = _all_reduce_sum(
        [volatility.changed_count, volatility.intersection_count, volatility.tokens, volatility.changed_any_count],
        group,
    )
    return RoutingVolatility(changed, intersection, tokens, volatility.top_k, changed_any)


def all_reduce_expert_load(load: ExpertLoad, group=None) -> ExpertLoad:
    """Merge the expert load of every rank in ``group`` (all ranks must pass the same L and E)."""
    counts, tokens = _all_reduce_sum([load.counts, load.tokens], group)
    return ExpertLoad(counts, tokens, load.top_k)
