"""Cutting a response into reasoning steps / segments, shared by Step-GRPO and GRSP.

Design decisions:
- Trigger words are matched by the one rule in ``gspo_megatron/core/trigger_words.py`` (standalone words,
  case-sensitive by default, multi-word triggers, longest first), which Dynamic Truncated Rollout
  uses too.
- Step count (Step-GRPO, arXiv 2604.16890): k = 1 + number of trigger occurrences. An empty
  response therefore has k = 1 (the formula, unchanged).
- Keyword segments: the text is cut at the start of every trigger occurrence; whitespace-only pieces
  (e.g. before a response that opens with "Wait") are dropped, so an empty response has no segment.
  Segment lengths are reported in TOKENS, estimated as the segment's share of the characters times
  the response's token count -- the group carries no token-to-character alignment, and tokens keep
  keyword and confidence segments in one unit so the same length-cluster edges serve both.
- Confidence segments (GRSP, arXiv 2510.09535, reconstructed): token t > 0 starts a new segment when
  its rollout log-prob is below ``threshold`` and is a local minimum within ``window`` tokens on each
  side (strictly lower than the tokens before it, no higher than those after it, so a plateau of equal
  minima yields one boundary, at its first token). Lengths are exact token counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from gspo_megatron.core.trigger_words import trigger_matches


def count_trigger_words(text: str, triggers: Sequence[str], case_sensitive: bool = True) -> int:
    return len(trigger_matches(text, triggers, case_sensitive))


def step_counts(texts: Sequence[str], triggers: Sequence[str], case_sensitive: bool = True) -> torch.Tensor:
    """long [G]: k_i = 1 + number of standalone trigger words (Step-GRPO)."""
    return torch.tensor([1 + count_trigger_words(text, triggers, case_sensitive) for text in texts], dtype=torch.long)


def keyword_segment_spans(text: str, triggers: Sequence[str], case_sensitive: bool = True) -> list[tuple[int, int]]:
    """Character spans [start, end) of the segments, cut at each trigger's start; blank pieces dropped."""
    cuts = [0] + [m.start() for m in trigger_matches(text, triggers, case_sensitive)] + [len(text)]
    return [(a, b) for a, b in pairwise(cuts) if text[a:b].strip()]


def keyword_segment_lengths(
    text: str, num_tokens: int, triggers: Sequence[str], case_sensitive: bool = True
) -> torch.Tensor:
    """float [S]: keyword segments' lengths in tokens, estimated as char share * num_tokens."""
    spans = keyword_segment_spans(text, triggers, case_sensitive)
    if not spans:
        return torch.zeros(0)
    chars = torch.tensor([b - a for a, b in spans], dtype=torch.float32)
    return chars * (num_tokens / len(text))


def keyword_segment_counts(
    texts: Sequence[str],
    num_tokens: Sequence[int],
    triggers: Sequence[str],
    bucket_edges: Sequence[float],
    case_sensitive: bool = True,
) -> torch.Tensor:
    """float [G, K]: each text's keyword segments per length cluster, equal to ``cluster_counts`` of each
    text's ``keyword_segment_lengths``: the same float32 lengths (chars * (num_tokens / len(text)), the scale
    rounded to float32 as a tensor times a Python float rounds it), bucketed and counted in one pass of
    tensor ops for the whole group instead of four per text -- the shaping metrics of every step of every
    run count them (256 texts a step in the main job: 5-7 ms as per-text tensors, ``tools/bench_rl_step.py``)."""
    chars: list[int] = []
    scales: list[float] = []
    rows: list[int] = []
    for row, (text, n) in enumerate(zip(texts, num_tokens, strict=True)):
        spans = keyword_segment_spans(text, triggers, case_sensitive)
        if not spans:  # an empty or blank text
            continue
        chars += [b - a for a, b in spans]
        scales += [n / len(text)] * len(spans)
        rows += [row] * len(spans)
    lengths = torch.tensor(chars, dtype=torch.float32) * torch.tensor(scales, dtype=torch.float32)
    return _counts_per_row(lengths, torch.tensor(rows, dtype=torch.long), len(texts), bucket_edges)


def confidence_boundaries(log_probs: torch.Tensor, window: int, threshold: float) -> torch.Tensor:
    """long [B]: token positions t > 0 where a new segment starts (low-confidence local minima)."""
    if window < 1:
        raise ValueError(f"confidence window must be >= 1 token, got {window}")
    values = log_probs.detach().float().reshape(-1)
    n = values.numel()
    if n < 2:
        return torch.zeros(0, dtype=torch.long)
    inf = torch.full((window,), float("inf"))
    padded = torch.cat([inf, values, inf])
    is_min = values < threshold
    for offset in range(1, window + 1):
        before = padded[window - offset : window - offset + n]
        after = padded[window + offset : window + offset + n]
        is_min &= (values < before) & (values <= after)
    is_min[0] = False  # the response's first token already starts a segment
    return is_min.nonzero().flatten()


def confidence_segment_lengths(log_probs: torch.Tensor, window: int, threshold: float) -> torch.Tensor:
    """float [S]: token lengths of the segments between confidence boundaries (empty response: [])."""
    n = log_probs.numel()
    if n == 0:
        return torch.zeros(0)
    cuts = torch.cat(
        [torch.zeros(1, dtype=torch.long), confidence_boundaries(log_probs, window, threshold), torch.tensor([n])]
    )
    return cuts.diff().float()


def cluster_counts(segment_lengths: Sequence[torch.Tensor], bucket_edges: Sequence[float]) -> torch.Tensor:
    """float [G, K]: segments per length cluster; cluster k holds lengths in [edge_{k-1}, edge_k).

    K = len(bucket_edges) + 1: cluster 0 is [0, edge_0), the last is [edge_{K-2}, inf).
    """
    sizes = torch.tensor([lengths.numel() for lengths in segment_lengths], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(segment_lengths)), sizes)
    lengths = torch.cat([lengths.float() for lengths in segment_lengths]) if segment_lengths else torch.zeros(0)
    return _counts_per_row(lengths, rows, len(segment_lengths), bucket_edges)


def _counts_per_row(
    lengths: torch.Tensor, rows: torch.Tensor, num_rows: int, bucket_edges: Sequence[float]
) -> torch.Tensor:
    """float [num_rows, K]: how many of the segments (``lengths`` [N], each of row ``rows`` [N]) fall in each
    length cluster (``cluster_counts``' clusters), bucketed and counted in one pass for all rows."""
    edges = torch.tensor(list(bucket_edges), dtype=torch.float32)
    num_clusters = edges.numel() + 1
    cells = rows * num_clusters + torch.bucketize(lengths.float(), edges, right=True)
    return torch.bincount(cells, minlength=num_rows * num_clusters).reshape(num_rows, num_clusters).float()
