"""The rollout-engine interface shared by the embedded engine and SGLang.

The trainer talks to this class only. Weights arrive as Hugging-Face-named tensors (the exporter in
``gspo_megatron.policy.models`` yields them), so both engines are fed by the same path.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping

import torch

from gspo_megatron.contracts.samples import RowRequest, Sample, SamplingParams


class RolloutEngine(abc.ABC):
    """Generates samples from token-id prompts and receives weight updates from the trainer."""

    weight_version: int = 0

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        """Return ``params.n`` samples for each prompt, in prompt order."""

    def generate_rows(self, rows: list[RowRequest], params: SamplingParams, groups_needed: int) -> list[Sample]:
        """One sample per row (``params.n`` and ``params.max_new_tokens`` give way to the rows), in row order;
        generation stops once ``groups_needed`` groups (rows sharing ``RowRequest.group``) have all their rows
        finished, and the rows still running then (or not started) come back with ``FinishReason.ABORT``
        and the tokens they have. Over-sampling and partial rollouts (``rollout/agents/partial.py``)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot stop generation once enough groups are complete: rollout.over_sample "
            "> 1 needs the embedded engine (rollout.engine=embedded)"
        )

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors (streamed; any subset of the model) and set the weight version."""

    def release_memory(self) -> None:  # noqa: B027 - optional: an engine with nothing to give back keeps it
        """Colocated placement: give the device memory (weights, KV cache) back after generating."""

    def resume_memory(self) -> None:  # noqa: B027 - optional, as release_memory
        """Colocated placement: take it again, before the weights are loaded and generation starts."""

    def health(self) -> Mapping[str, object]:
        """A small status dict; raises if the engine cannot serve."""
        return {"ok": True, "weight_version": self.weight_version}

    def shutdown(self) -> None:  # noqa: B027 - an optional hook: engines without resources keep it
        """Release resources (stop servers this engine started). Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
