"""Loss-head callbacks for megatron's schedule: token log-probs and the policy loss (plus the
entropy bonus and reference KL when their coefficients are non-zero).

Runs on the last pipeline stage, on vocab-parallel logits [b, s, V/tp]. The math lives in
``gspo_megatron.algorithms``; this module only plumbs: which tensors of the micro-batch feed it,
which denominators and groups it uses, and which metrics come back. ``PolicyLossHead``'s metric
entries carry the names the run logs (the loss's own and the KL's under ``loss/``, the policy's
entropy as ``entropy``): the trainer reduces them and renames nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gspo_megatron.algorithms.config import AlgorithmConfig
from gspo_megatron.algorithms.logprobs import vocab_parallel_log_probs
from gspo_megatron.algorithms.losses import LossContext, get_policy_loss
from gspo_megatron.algorithms.metrics import mean_entries, token_mean_metric
from gspo_megatron.algorithms.off_policy_masking import off_policy_sequence_mask
from gspo_megatron.algorithms.reductions import context_parallel_sequence_sum_fn
from gspo_megatron.algorithms.regularizers import entropy_bonus, kl_penalty
from gspo_megatron.contracts.micro_batch import MicroBatch, UpdateMicroBatch
from gspo_megatron.policy.parallel.context_parallel import gather_sequence

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass
class LogProbOutput:
    """What ``LogProbHead`` hands back per micro-batch (last pipeline stage): whole rows."""

    log_probs: torch.Tensor  # [b, s] log pi(target) at the head's temperature
    entropy: torch.Tensor  # [b, s] entropy of the same distribution


@dataclass
class LogProbHead:
    """Forward-only: per-token log-probs of the targets (old policy, or a reference pass)."""

    tp_group: ProcessGroup | None
    temperature: float
    chunk_size: int | None = None
    cp_group: ProcessGroup | None = None  # context parallel: the rank's share of each row -> whole rows

    def __call__(self, logits: torch.Tensor, batch: MicroBatch) -> tuple[torch.Tensor, LogProbOutput]:
        with torch.no_grad():
            log_probs, entropy = vocab_parallel_log_probs(
                logits,
                batch.targets,
                tp_group=self.tp_group,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                with_entropy=True,
            )
            log_probs, entropy = (gather_sequence(t, self.cp_group) for t in (log_probs, entropy))
        return logits.new_zeros(()), LogProbOutput(log_probs, entropy)


@dataclass
class PolicyLossHead:
    """The policy-gradient loss of one micro-batch, normalised by whole-mini-batch denominators."""

    algorithm: AlgorithmConfig
    tp_group: ProcessGroup | None
    cp_group: ProcessGroup | None
    temperature: float
    global_num_sequences: torch.Tensor
    global_num_tokens: torch.Tensor
    clip: tuple[float, float] | None = None  # this step's (eps_low, eps_high) from the adaptive controller
    chunk_size: int | None = None  # trainer.logprob_chunk_size

    def __post_init__(self) -> None:
        self.loss_fn = get_policy_loss(self.algorithm.loss.name)
        self.sequence_sum = context_parallel_sequence_sum_fn(self.cp_group)

    def __call__(self, logits: torch.Tensor, batch: UpdateMicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        algorithm = self.algorithm
        log_probs, entropy = vocab_parallel_log_probs(
            logits,
            batch.targets,
            tp_group=self.tp_group,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            with_entropy=True,
            entropy_grad=algorithm.loss.entropy_coef != 0,
        )
        ctx = LossContext(
            algorithm.loss,
            global_num_sequences=self.global_num_sequences.to(logits.device),
            global_num_tokens=self.global_num_tokens.to(logits.device),
            sequence_sum=self.sequence_sum,
            clip=self.clip,
        )
        mask, old_log_probs, advantages = batch.response_mask, batch.old_log_probs, batch.advantages
        opsm: dict[str, torch.Tensor] = {}
        if algorithm.loss.opsm_delta is not None:  # slime's off-policy sequence masking
            advantages, opsm = off_policy_sequence_mask(
                log_probs, old_log_probs, advantages, mask, algorithm.loss.opsm_delta, self.sequence_sum
            )
        out = self.loss_fn(log_probs, old_log_probs, advantages, mask, ctx)
        metrics = _under_loss(out.metrics)
        metrics.update(opsm)
        metrics.update(token_mean_metric("entropy", entropy, mask, self.sequence_sum))
        # The losses of all micro-batches and ranks add up to the mini-batch loss; a count equal to
        # this micro-batch's share of the sequences makes the merged "mean" that total.
        share = torch.as_tensor(float(mask.shape[0]), device=logits.device) / self.global_num_sequences.to(
            logits.device
        )
        metrics.update(mean_entries("loss/policy", out.loss.detach(), share))
        loss = out.loss
        if algorithm.loss.entropy_coef != 0:
            term = entropy_bonus(entropy, mask, ctx, algorithm.loss.entropy_coef)
            metrics.update(mean_entries("loss/entropy_term", term.detach(), share))
            loss = loss + term
        if algorithm.kl.coef != 0:
            term, kl_metrics = kl_penalty(
                log_probs, batch.ref_log_probs, mask, ctx, algorithm.kl.coef, algorithm.kl.estimator
            )
            metrics.update(_under_loss(kl_metrics))
            metrics.update(mean_entries("loss/kl_term", term.detach(), share))
            loss = loss + term
        return loss, metrics


def _under_loss(entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loss functions' metric entries (``ratio/sum``, ...) as logged: ``loss/ratio/sum``."""
    return {f"loss/{key}": value for key, value in entries.items()}
