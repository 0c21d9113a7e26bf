"""What a reward shaper takes (one prompt's group of responses) and returns.

Design decisions:
- A shaper sees exactly one prompt's G responses at a time: every shaper here is group-relative
  (means, z-scores, min/max over the group), and the group is also the unit of the advantage
  estimator that runs right after shaping.
- The group carries both text (for trigger-word step counting) and per-token rollout log-probs (for
  confidence segmentation), plus the verifier's outcome split into reward / correct / format_ok, so
  shapers that replace the reward (Step-GRPO) and shapers that adjust it (GRSP, DAPO, Kimi) share one
  input type.
- Inputs are validated once, on construction, with errors that say which field is wrong and how.
- Shapers never modify the group; they return new tensors in ``ShapedRewards``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gspo_megatron.contracts.samples import Sample
from gspo_megatron.rollout.shaping.segmentation import step_counts


def _check_vector(name: str, value: object, size: int, kind: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"ShapingGroup.{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 1 or value.numel() != size:
        raise ValueError(f"ShapingGroup.{name} has shape {tuple(value.shape)}, expected ({size},)")
    ok = {
        "float": value.is_floating_point(),
        "bool": value.dtype == torch.bool,
        "int": not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool,
    }[kind]
    if not ok:
        raise TypeError(f"ShapingGroup.{name} must be a {kind} tensor, got dtype {value.dtype}")


@dataclass(frozen=True)
class ShapingGroup:
    """One prompt's G responses, as the shapers need them."""

    rewards: torch.Tensor  # float [G], the verifier's reward
    correct: torch.Tensor  # bool [G], verifier says the final answer is right
    format_ok: torch.Tensor  # bool [G], response follows the required output format
    response_texts: list[str]  # G decoded responses (what trigger words are counted in)
    response_lengths: torch.Tensor  # long [G], response tokens
    max_response_length: int  # the rollout's max_new_tokens
    steps: torch.Tensor  # long [G]: reasoning steps, 1 + the trigger words (shaping.trigger_words) in each text
    token_log_probs: list[torch.Tensor] | None = None  # G float [len_i] rollout log-probs
    # long [G]: trigger words a Dynamic Truncated Rollout dropped at a confident exit (0 or 1 each);
    # None: no truncated rollout. Not in response_texts (the trigger is removed before the exit).
    dropped_triggers: torch.Tensor | None = None

    def __post_init__(self):
        if not isinstance(self.rewards, torch.Tensor) or self.rewards.dim() != 1 or self.rewards.numel() < 1:
            raise ValueError("ShapingGroup.rewards must be a non-empty 1-D float tensor [G]")
        size = self.rewards.numel()
        _check_vector("rewards", self.rewards, size, "float")
        _check_vector("correct", self.correct, size, "bool")
        _check_vector("format_ok", self.format_ok, size, "bool")
        _check_vector("response_lengths", self.response_lengths, size, "int")
        _check_vector("steps", self.steps, size, "int")
        if len(self.response_texts) != size:
            raise ValueError(f"ShapingGroup.response_texts has {len(self.response_texts)} entries, expected {size}")
        if bool((self.response_lengths < 0).any()):
            raise ValueError("ShapingGroup.response_lengths must be >= 0")
        if self.max_response_length < 1:
            raise ValueError(f"ShapingGroup.max_response_length must be >= 1, got {self.max_response_length}")
        if self.token_log_probs is not None:
            if len(self.token_log_probs) != size:
                raise ValueError(
                    f"ShapingGroup.token_log_probs has {len(self.token_log_probs)} entries, expected {size}"
                )
            lengths = self.response_lengths.tolist()
            for i, (log_probs, length) in enumerate(zip(self.token_log_probs, lengths, strict=True)):
                if log_probs.dim() != 1 or log_probs.numel() != length:
                    raise ValueError(
                        f"ShapingGroup.token_log_probs[{i}] has shape {tuple(log_probs.shape)}, expected "
                        f"({length},) -- one log-prob per response token"
                    )

        if self.dropped_triggers is not None:
            _check_vector("dropped_triggers", self.dropped_triggers, size, "int")

    @property
    def size(self) -> int:
        return self.rewards.numel()


@dataclass
class ShapedRewards:
    """A shaper's output: the rewards handed to the advantage estimator, and tensor metrics.

    Metric values are tensors: 0-dim for per-group scalars, or with a leading dimension G for
    per-response values (e.g. [G] steps, [G, K] segments per length cluster).
    """

    rewards: torch.Tensor  # float [G]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def group_from_samples(
    samples: Sequence[Sample],
    rewards: torch.Tensor,
    correct: torch.Tensor,
    format_ok: torch.Tensor,
    response_texts: Sequence[str],
    max_response_length: int,
    trigger_words: Sequence[str],
    case_sensitive: bool = True,
) -> ShapingGroup:
    """Build a group from one prompt's rollout samples (lengths and log-probs come from the samples,
    the steps from their texts' ``trigger_words``)."""
    return ShapingGroup(
        rewards=rewards,
        correct=correct,
        format_ok=format_ok,
        response_texts=list(response_texts),
        response_lengths=torch.tensor([len(s.output_ids) for s in samples], dtype=torch.long),
        max_response_length=max_response_length,
        steps=step_counts(response_texts, trigger_words, case_sensitive),
        token_log_probs=[s.output_log_probs.float() for s in samples],
        dropped_triggers=(
            torch.tensor([s.truncation is not None and s.truncation.confident for s in samples], dtype=torch.long)
            if any(s.truncation is not None for s in samples)
            else None
        ),
    )
