"""What every rollout engine takes and returns.

Design decisions:
- Token ids in, token ids out: prompts are already tokenised by the data layer, so the engine never
  re-tokenises and the trainer scores exactly the tokens that were sampled.
- Per-token log-probs are those of the sampling distribution (temperature applied), one per output
  token, so the trainer can compare them with its own recomputation (train/inference mismatch).
- Routed experts, when asked for, follow SGLang's layout: int32 [prompt_len + output_len - 1,
  num_layers, top_k] -- the last sampled token has no row because it was never fed to the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum

import torch

# Sample.extra key: the weight version of each output token (a sample continued over steps or turns; an
# inserted token carries the version of the turn before it). Absent: every token is ``weight_version``'s
TOKEN_VERSIONS = "token_versions"


class FinishReason(str, Enum):
    STOP = "stop"  # a stop token / string ended the sample (EOS included)
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # the engine gave up on the request (server abort, shutdown)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering (SGLang's convention)
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # samples per prompt
    seed: int | None = None
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")


@dataclass(frozen=True)
class RowRequest:
    """One sample to generate on its own (``RolloutEngine.generate_rows``): partial rollouts continue a
    sample an earlier step stopped by giving its prompt followed by what it generated so far."""

    prompt_ids: list[int]  # the model's input: a prompt, or a prompt and an unfinished sample's tokens
    max_new_tokens: int  # this row's budget (what the sample has left of rollout.max_new_tokens)
    group: int  # rows of one group (one prompt's samples) share it: a group is complete when all finished

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"a row needs a budget of >= 1 new tokens, got {self.max_new_tokens}")


class ExitReason(StrEnum):
    """How a truncated rollout's thinking ended (``rollout/agents/truncated.py`` says when each happens)."""

    confident = "confident"
    think_budget = "think_budget"
    repetition = "repetition"
    natural_end = "natural_end"
    max_probes = "max_probes"
    length = "length"
    abort = "abort"


@dataclass
class Truncation:
    """How a Dynamic Truncated Rollout (``rollout/agents/truncated.py``) ended a sample's thinking."""

    exit_reason: str | None  # an ExitReason (None only if the trace ended without setting one)
    num_probes: int
    probe_confidences: list[float]
    forced_mask: torch.Tensor  # bool [len(output_ids)]: tokens inserted (not sampled); kept out of the loss

    @property
    def confident(self) -> bool:
        """A probe passed: the thinking was cut there (its trigger dropped)."""
        return self.exit_reason == ExitReason.confident

    @property
    def forced_tokens(self) -> int:
        return int(self.forced_mask.sum())


@dataclass(frozen=True)
class TurnSpan:
    """One turn of a multi-turn trajectory: the output tokens ``[start, end)`` the model generated in it."""

    start: int
    end: int
    weight_version: int  # the weights that generated them


@dataclass
class Sample:
    """One generated response to one prompt -- or one multi-turn trajectory (``rollout/agents/``): its
    output is every turn's generated tokens with the inserted ones (tool answers, template) between them."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: torch.Tensor  # float32 [len(output_ids)], log-prob under the sampling distribution
    finish_reason: FinishReason
    routed_experts: torch.Tensor | None = None  # int32 [len(prompt)+len(output)-1, layers, top_k]
    weight_version: int = 0  # the engine's weight version that produced this sample (the oldest, over turns)
    truncation: Truncation | None = None  # set by a truncated rollout
    extra: dict = field(default_factory=dict)  # engine-specific details (e.g. SGLang's weight versions)
    # bool [len(output_ids)]: tokens the model did not sample (a tool's answer, the chat template around it);
    # their log-probs are 0.0, they never enter the loss or a comparison with the engine. None: none inserted
    inserted_mask: torch.Tensor | None = None
    turns: list[TurnSpan] | None = None  # a trajectory's turns, in order; None: one response

    @property
    def answer_ids(self) -> list[int]:
        """What a reward scores: a trajectory's last turn, else the whole output."""
        if not self.turns:
            return self.output_ids
        last = self.turns[-1]
        return self.output_ids[last.start : last.end]

    def __post_init__(self) -> None:
        if self.output_log_probs.shape != (len(self.output_ids),):
            raise ValueError(
                f"output_log_probs has shape {tuple(self.output_log_probs.shape)}, expected "
                f"({len(self.output_ids)},) -- one log-prob per output token"
            )
        if self.inserted_mask is not None and self.inserted_mask.shape != (len(self.output_ids),):
            raise ValueError(
                f"inserted_mask has shape {tuple(self.inserted_mask.shape)}, expected ({len(self.output_ids)},)"
            )
        if self.truncation is not None and self.truncation.forced_mask.shape != (len(self.output_ids),):
            raise ValueError(
                f"truncation.forced_mask has shape {tuple(self.truncation.forced_mask.shape)}, expected "
                f"({len(self.output_ids)},) -- one flag per output token"
            )
        if self.routed_experts is not None:
            rows = len(self.prompt_ids) + len(self.output_ids) - 1
            if self.routed_experts.dim() != 3 or self.routed_experts.shape[0] != rows:
                raise ValueError(
                    f"routed_experts has shape {tuple(self.routed_experts.shape)}, expected "
                    f"[{rows}, num_layers, top_k] (prompt + output tokens - 1)"
                )
