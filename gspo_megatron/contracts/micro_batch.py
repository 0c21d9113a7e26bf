"""One micro-batch of megatron's schedule: what a forward reads and what the loss heads score.

Built by the trainer (``contracts/batch.py``) from the step's padded rollout batch, and by tools and
tests from plain token tensors. ``policy/models/schedule.py`` moves it to the device and splits it over
context-parallel ranks; the loss heads (``policy/loss_heads.py``) read its fields.

Two typed kinds of it say which fields are set, so readers need no runtime check: ``StepMicroBatch``
(cut from a step's rollout batch: rows, masks and advantages) and ``UpdateMicroBatch`` (with pi_old:
every field the policy loss reads).

``shared_prefix`` (``trainer.shared_prefix``; ``contracts/shared_prefix.py``): the packed layout the model is
fed instead of ``tokens`` where rows share their prompt; every other field stays in the row layout, which is
what the loss heads see (``policy/models/schedule.py`` gathers the logits back).

Shapes: b rows of s fed tokens. Per-token fields are [b, s] (routed experts [b, s, layers, k]),
aligned to the targets: position t scores ``targets[:, t]``, the token after ``tokens[:, t]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gspo_megatron.contracts.shared_prefix import SharedPrefixLayout


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # long [b, s]: the fed input tokens
    targets: torch.Tensor  # long [b, s]: the next token of each input
    rows: torch.Tensor | None = None  # long [b]: the rows' global indices in the step's rollout batch
    response_mask: torch.Tensor | None = None  # float [b, s]: 1 where the target is a response token
    input_mask: torch.Tensor | None = None  # float [b, s]: 1 where the input token is real (not padding)
    advantages: torch.Tensor | None = None  # float [b] (or [b, s] for token-level advantages)
    old_log_probs: torch.Tensor | None = None  # float [b, s]: pi_old of the targets
    rollout_log_probs: torch.Tensor | None = None  # float [b, s]: the engine's log-probs of the targets
    ref_log_probs: torch.Tensor | None = None  # float [b, s]: the reference model's (KL penalty)
    routed_experts: torch.Tensor | None = None  # int [b, s, layers, k]: the engine's experts (R3)
    weights: torch.Tensor | None = None  # float [b, s]: per-token weights of a supervised loss (tools, tests)
    position_ids: torch.Tensor | None = None  # long [b, s]; None: positions 0..s-1 (global under CP)
    input_turns: torch.Tensor | None = None  # long [b, s]: the turn that fed each input (multi-turn; diagnostics)
    shared_prefix: SharedPrefixLayout | None = None  # the packed layout fed instead of ``tokens`` (module notes)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name (for generic per-field operations)."""
        return {f.name: v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}

    def map_per_token(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        """A copy with ``fn`` applied to every per-token field ([b, s, ...]); per-row fields kept. Not of a
        micro-batch with a shared-prefix layout, whose packed tensors would no longer match its rows."""
        if self.shared_prefix is not None:
            raise ValueError("a micro-batch with a shared-prefix layout cannot be cut per token")
        mapped: dict[str, Any] = {
            k: fn(v) for k, v in self.tensors().items() if v.dim() >= 2 and v.shape[1] == self.seq_len
        }
        return dataclasses.replace(self, **mapped)

    def to(self, device: torch.device | str) -> MicroBatch:
        moved: dict[str, Any] = {k: v.to(device, non_blocking=True) for k, v in self.tensors().items()}
        if self.shared_prefix is not None:
            moved["shared_prefix"] = self.shared_prefix.to(device)
        return dataclasses.replace(self, **moved)


@dataclass(kw_only=True)
class StepMicroBatch(MicroBatch):
    """A micro-batch cut from a step's rollout batch (``contracts/batch.py``'s ``micro_batch``): its rows
    and every per-row field the step's phases read are set."""

    rows: torch.Tensor = field()  # long [b]: the rows' global indices in the step's rollout batch
    response_mask: torch.Tensor = field()
    input_mask: torch.Tensor = field()
    advantages: torch.Tensor = field()


@dataclass(kw_only=True)
class UpdateMicroBatch(StepMicroBatch):
    """What the policy loss reads (``policy/loss_heads.py``'s ``PolicyLossHead``): a step's micro-batch
    with pi_old (and the reference's log-probs, the mismatch correction's advantages and masks), built
    once after the phases that compute them (``contracts/batch.py``'s ``update_batches``); nothing is
    filled in later."""

    old_log_probs: torch.Tensor = field()
