"""Next-token sampling for the embedded engine: temperature, top-k, top-p, greedy, seeded.

Design decisions:
- The reported log-prob of a sampled token is log_softmax(logits / T) at that token, computed BEFORE
  top-k / top-p filtering. That is the quantity the trainer recomputes from its own logits (it never
  applies top-k/top-p), so the rollout-vs-trainer comparison measures engine mismatch, not the
  filter's renormalisation. With filtering on, the sampler's true probability of the token is larger
  by 1 / (kept mass); callers who need importance weights against the filtered sampler must correct.
- Greedy (T = 0) reports log_softmax(logits) (temperature 1): the T -> 0 limit is degenerate (log-prob
  0), while the T = 1 value is what a confidence probe (truncated rollout) and the trainer use.
- Randomness comes from one ``torch.Generator`` per row, drawn from the request seed, and one uniform
  per row per step (inverse-CDF sampling). A row's sample therefore does not depend on which other
  rows share its batch, so chunking by ``max_batch_size`` cannot change results.
- A row's uniforms are drawn ``UNIFORM_BLOCK`` steps at a time (``RowUniforms``): torch's CPU generator
  gives ``rand(n)`` the same numbers as n calls of ``rand(())`` (tested), so the tokens are those of one
  draw per step, for one tensor op per row per block instead of one per row per token (256 rows x 3
  tokens in the main job: 1.8 ms of draws and stacks a ``generate``, 0.7 ms by blocks; CPU time, 1 thread).
"""

from __future__ import annotations

import torch

from gspo_megatron.contracts.samples import SamplingParams


def sampling_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi_T(. | context) = log_softmax(logits / T); T = 0 (greedy) reports T = 1."""
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1)


def filter_top_k_top_p(scaled_logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the nucleus to -inf, following SGLang's sampler.

    Nucleus (Holtzman et al. 2020): sort tokens by probability; drop a token when the mass of the
    tokens ranked strictly above it already exceeds ``top_p``. As in SGLang, that mass is measured on
    the temperature-scaled distribution BEFORE top-k (not renormalised after it), and top-k is then
    intersected; the most likely token is always kept. Ties at the k-th value are all kept.
    """
    logits = scaled_logits
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of better-ranked tokens
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before > top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth_value = torch.topk(scaled_logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(scaled_logits < kth_value, float("-inf"))
    return logits


UNIFORM_BLOCK = 64  # steps of uniforms a row draws at once (memory: rows x 64 floats)


def row_generators(seed: int, rows: int) -> list[torch.Generator]:
    """One generator per row; row seeds are drawn from ``seed`` so rows differ but stay reproducible."""
    root = torch.Generator().manual_seed(seed)
    row_seeds = torch.randint(0, 2**62, (rows,), generator=root).tolist()
    return [torch.Generator().manual_seed(int(row_seed)) for row_seed in row_seeds]


class RowUniforms:
    """Row r's uniform of step t is the t-th draw of ``generators[r]`` (one per step it decoded, from 0),
    drawn ``UNIFORM_BLOCK`` steps ahead (module docstring); a row draws at every step until it leaves."""

    def __init__(self, generators: list[torch.Generator]):
        self.generators = generators
        self._table = torch.empty(len(generators), 0)
        self._first_step = 0

    def at(self, rows: list[int], step: int) -> torch.Tensor:
        """float [len(rows)]: each row's uniform of ``step`` (steps asked in order, every row at each)."""
        if step >= self._first_step + self._table.shape[1]:
            self._table = torch.stack([torch.rand(UNIFORM_BLOCK, generator=g) for g in self.generators])
            self._first_step = step
        return self._table[rows, step - self._first_step]


def sample_next_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V] with the rows' ``uniforms`` [B] (``RowUniforms``; None when
    greedy); return (tokens int64 [B], log-probs float32 [B])."""
    logits = logits.float()
    log_probs = sampling_log_probs(logits, params.temperature)
    if params.temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
    else:
        filtered = filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
        cdf = torch.cumsum(torch.softmax(filtered, dim=-1), dim=-1)
        if uniforms is None:
            raise ValueError(f"sampling at temperature {params.temperature} needs the rows' uniforms (RowUniforms)")
        uniforms = uniforms.to(cdf.device)
        # inverse CDF: first token whose cumulative mass exceeds u * total (u in [0, 1)); tokens with
        # zero mass never satisfy it, so filtered tokens are never chosen
        threshold = (uniforms * cdf[:, -1]).unsqueeze(-1)
        tokens = torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    chosen = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen
