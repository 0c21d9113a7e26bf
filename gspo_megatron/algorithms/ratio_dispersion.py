"""How noisy the importance ratios are, token-level w vs sequence-level s, as a function of length.

GSPO's argument (arXiv 2507.18071, section 3): GRPO's token ratio w_{i,t} = pi_theta(y_t|..)/pi_old(y_t|..)
is one sample per token, so its noise accumulates over long responses, while GSPO's sequence ratio
s_i = exp((1/|y_i|) sum_t log w_{i,t}) averages it away. These metrics measure both, logged by every
loss (whatever ratio it optimises), so runs of different algorithms are compared on the same numbers:

    ratio_var_token/len_a_b = E_t[(w_{i,t} - 1)^2]  over the tokens of responses with a <= |y_i| <= b
    ratio_var_seq/len_a_b   = E_i[(s_i - 1)^2]      over those responses
    ratio_token_seq_gap     = E_t[|w_{i,t} - s_i|]  how far a sequence ratio is from the token ratios it summarises

(r - 1)^2 is the dispersion about 1, the on-policy value (E_{pi_old}[w] = 1), so it is a variance up
to the small bias of off-policy sampling. Everything is returned as additive sums and counts
(``metrics.mean_entries``), so micro-batches and ranks merge exactly; an empty bucket finalises to NaN.
Sums over a sequence go through ``sequence_sum`` (the CP reducer under context parallelism).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gspo_megatron.algorithms.metrics import mean_entries

# Response-length buckets (inclusive; None: no upper bound). One-token answers fall in the first.
LENGTH_BUCKETS: tuple[tuple[int, int | None], ...] = ((1, 4), (5, 16), (17, 64), (65, None))


def bucket_name(low: int, high: int | None) -> str:
    return f"len_{low}_{high}" if high is not None else f"len_{low}_up"


def ratio_dispersion_metrics(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor],
    log_ratio_clamp: float = 20.0,
) -> dict[str, torch.Tensor]:
    """``log_ratio`` [B, T] (log pi_theta - log pi_old, 0 off-mask), ``mask`` bool [B, T], ``lengths`` [B]
    whole-sequence valid-token counts."""
    with torch.no_grad():
        log_w = log_ratio.detach().float().clamp(-log_ratio_clamp, log_ratio_clamp)
        w = log_w.exp()
        lengths = lengths.detach().float()
        log_s = (sequence_sum(torch.where(mask, log_w, 0.0)) / lengths.clamp_min(1)).clamp(
            -log_ratio_clamp, log_ratio_clamp
        )
        s = log_s.exp()  # [B]
        token_sq = sequence_sum(torch.where(mask, (w - 1) ** 2, 0.0))  # [B]: sum_t (w - 1)^2
        gap = sequence_sum(torch.where(mask, (w - s.unsqueeze(-1)).abs(), 0.0))  # [B]: sum_t |w - s|
        valid = lengths > 0
        metrics = mean_entries("ratio_token_seq_gap", gap[valid].sum(), lengths[valid].sum())
        for low, high in LENGTH_BUCKETS:
            in_bucket = valid & (lengths >= low) & (lengths <= (high if high is not None else float("inf")))
            name = bucket_name(low, high)
            metrics.update(mean_entries(f"ratio_var_token/{name}", token_sq[in_bucket].sum(), lengths[in_bucket].sum()))
            metrics.update(mean_entries(f"ratio_var_seq/{name}", ((s - 1) ** 2)[in_bucket].sum(), in_bucket.sum()))
    return metrics
