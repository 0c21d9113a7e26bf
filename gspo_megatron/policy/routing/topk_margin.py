"""The router's top-k margin: how close each token's k-th expert is to being swapped out by the (k+1)-th.

Per token and MoE layer, with z_(1) >= z_(2) >= ... the scores megatron's top-k ranks:

    margin = z_(k) - z_(k+1)        (>= 0; 0: a tie, the smallest change to the router swaps an expert)

An update changes a token's expert set only where it moves z_(k) and z_(k+1) past each other, so the
margin distribution says how much routing volatility a given policy movement buys: many small margins,
much volatility per unit of update KL. The GSPO paper's 48 x 128 top-8 router ranks 128 experts, so
its 8th and 9th are closer than a 32-expert router's 4th and 5th at the same logit spread.

Design decisions:
- The scores are those megatron's top-k ranks (``RoutingReplay`` sees them in its ``get_replay_topk``
  wrapper): the raw router logits when the softmax follows the top-k (``norm_topk_prob``, every model
  in ``conf/model/``), the probabilities when it precedes it, the sigmoid scores under
  ``router_score=sigmoid``. Group-limited routing is not accounted for (no model here uses it).
- Measured on the old-policy pass (the policy before the step's first update), over the real
  (non-padding) input tokens, where the ``update`` volatility is measured.
- A histogram over fixed edges (``MARGIN_EDGES``) per layer in int64 counts, and the float64 sum of
  the margins per layer: micro-batches and ranks merge exactly by addition, pipeline stages by
  concatenating their layers, and quantiles are read off the edges (``fraction_below``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# bin i holds margins in [MARGIN_EDGES[i], MARGIN_EDGES[i + 1]); the last bin [MARGIN_EDGES[-1], inf)
MARGIN_EDGES: tuple[float, ...] = (0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)


def topk_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [tokens]: each token's k-th largest score minus its (k+1)-th (``scores``: [tokens, experts])."""
    if scores.dim() != 2 or not 1 <= k < scores.shape[1]:
        raise ValueError(
            f"top-k margin needs scores [tokens, experts] with 1 <= k < experts, got {tuple(scores.shape)}, k={k}"
        )
    top = scores.detach().float().topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


@dataclass
class TopkMargins:
    """Per MoE layer: margin counts per bin of ``MARGIN_EDGES`` and the margins' float64 sum."""

    counts: torch.Tensor  # int64 [layers, len(MARGIN_EDGES)]
    sums: torch.Tensor  # float64 [layers]

    @property
    def tokens(self) -> torch.Tensor:
        """int64 [layers]: the (token, layer) margins counted."""
        return self.counts.sum(dim=-1)

    @property
    def mean(self) -> torch.Tensor:
        """float64 [layers]: the mean margin per layer."""
        return self.sums / self.tokens.clamp_min(1).double()

    def fraction_below(self, edge: float) -> float:
        """The share of every layer's (token, layer) margins below ``edge`` (one of ``MARGIN_EDGES``)."""
        if edge not in MARGIN_EDGES:
            raise ValueError(f"fraction_below reads the histogram at its edges {MARGIN_EDGES}, got {edge}")
        below = self.counts[:, : MARGIN_EDGES.index(edge)].sum()
        return float(below) / max(int(self.counts.sum()), 1)

    def merge(self, other: TopkMargins) -> TopkMargins:
        if self.counts.shape != other.counts.shape:
            raise ValueError(
                f"cannot merge top-k margins of {tuple(self.counts.shape)} and {tuple(other.counts.shape)} bins"
            )
        return TopkMargins(self.counts + other.counts, self.sums + other.sums)

    def to(self, device) -> TopkMargins:
        return TopkMargins(self.counts.to(device), self.sums.to(device))

    @staticmethod
    def concat_layers(parts: list[TopkMargins]) -> TopkMargins:
        """Pipeline stages' margins of the same tokens over disjoint layers, in stage order."""
        return TopkMargins(torch.cat([p.counts for p in parts]), torch.cat([p.sums for p in parts]))

    def metrics(self, prefix: str = "routing/topk_margin") -> dict[str, float]:
        """Scalars over every layer: the mean margin and the share below each positive edge."""
        total = max(int(self.counts.sum()), 1)
        out = {f"{prefix}_mean": float(self.sums.sum()) / total}
        for edge in MARGIN_EDGES[1:]:
            out[f"{prefix}_below_{edge:g}"] = self.fraction_below(edge)
        return out


def topk_margins(per_layer: list[torch.Tensor], token_mask: torch.Tensor) -> TopkMargins:
    """The histogram of one micro-batch's margins (``per_layer``: float [tokens] per MoE layer, megatron's
    token order) over the tokens where ``token_mask`` (bool [tokens]) is set."""
    edges = torch.tensor(MARGIN_EDGES, dtype=torch.float64)
    counts, sums = [], []
    for margin in per_layer:
        if margin.shape != token_mask.shape:
            raise ValueError(f"margins of {tuple(margin.shape)} tokens for a mask of {tuple(token_mask.shape)}")
        kept = margin[token_mask.to(margin.device)].double().cpu()
        # bucketize(right=True) - 1: the index i with edges[i] <= m < edges[i + 1]
        bins = (torch.bucketize(kept, edges, right=True) - 1).clamp(0, len(MARGIN_EDGES) - 1)
        counts.append(torch.bincount(bins, minlength=len(MARGIN_EDGES)))
        sums.append(kept.sum())
    return TopkMargins(torch.stack(counts).long(), torch.stack(sums).double())


def all_reduce_margins(margins: TopkMargins, group=None) -> TopkMargins:
    """Sum over the ranks that hold other tokens of the same layers."""
    counts, sums = margins.counts.clone(), margins.sums.clone()
    dist.all_reduce(counts, group=group)
    dist.all_reduce(sums, group=group)
    return TopkMargins(counts, sums)
