"""Off-policy sequence masking (OPSM): a sequence with a negative advantage whose current policy has drifted from
pi_old by more than delta leaves the policy-gradient term.

slime's formula (THUDM/slime 624b824, ``slime/utils/ppo_utils.py:compute_opsm_mask``, applied in
``slime/backends/megatron_utils/loss.py:policy_loss_function`` as ``pg_loss * opsm_mask``; ``--use-opsm``,
``--opsm-delta`` default 1e-4), per sequence i over its valid tokens m_{i,t}:

    KL_i = sum_t (log pi_old(y_{i,t}) - log pi_theta(y_{i,t})) m_{i,t} / max(sum_t m_{i,t}, 1)
    mask_{i,t} = 0  if A_{i,t} < 0 and KL_i > delta,  else 1

Design decisions:
- Applied as A_{i,t} := 0 where the mask is 0: every policy loss here is -A times a function of the ratio (the
  dual clip's floor c A too), so the token's loss and gradient are exactly pg_loss x 0, as in slime; the loss
  denominators are unchanged (slime keeps its loss masks).
- The mask is a constant: KL_i is read from detached log-probs. Under context parallelism the sums run over the
  whole sequence (the loss context's ``sequence_sum``), so every CP rank masks the same rows.
- Metric ``loss/opsm_masked_frac``: the fraction of sequences (with a valid token) masked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gspo_megatron.algorithms.metrics import mean_entries
from gspo_megatron.algorithms.reductions import local_sequence_sum


def off_policy_sequence_mask(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    delta: float,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] = local_sequence_sum,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages with the masked sequences' entries set to 0 (same shape: [B] or [B, T]) and metric entries."""
    mask = response_mask.bool()
    with torch.no_grad():
        drift = torch.where(mask, old_log_probs.float() - log_probs.detach().float(), 0.0)
        lengths = sequence_sum(mask.float())
        kl = sequence_sum(drift) / lengths.clamp_min(1.0)  # KL_i
        drifted = kl > delta  # [B]
        if advantages.dim() == 1:
            masked = drifted & (advantages < 0)
            masked_rows = masked
        else:
            masked = drifted.unsqueeze(-1) & (advantages < 0)
            masked_rows = sequence_sum((masked & mask).float()) > 0  # over the whole sequence under CP
        valid_rows = lengths > 0
        stats = mean_entries(
            "loss/opsm_masked_frac", (masked_rows & valid_rows).sum().float(), valid_rows.sum().float()
        )
    return torch.where(masked, torch.zeros_like(advantages), advantages), stats
