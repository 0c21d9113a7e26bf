"""The rollout-engine interface shared by the embedded engine and SGLang.

The trainer talks to this class only. Weights arrive as Hugging-Face-named tensors (the exporter in
``gspo_megatron.policy.models`` yields them), so both engines are fed by the same path.

Multi-turn trajectories (``rollout/agents/``) generate turn by turn (``generate_turns``): each turn
continues the trajectory's ``EngineSession`` -- the positions whose forward already ran -- and returns
the routed experts of the positions fed in that call only. A position's routing row is therefore the one
of the forward that computed its KV, never a later call's (Routing Replay across turns and weight
versions: ``docs/agents.md``). The embedded engine keeps each session's KV cache, so no position is fed
twice; an engine without a per-trajectory cache (the default below, SGLang) feeds the whole context again
each turn and returns its rows of the earlier positions as well (``TurnResult.earlier_rows``): the
trajectory keeps its own, and checks the engine's against them -- equal where the engine served those
positions from the KV it computed then (SGLang's prefix cache), different where it computed them again.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from gspo_megatron.contracts.samples import FinishReason, RowRequest, Sample, SamplingParams


@dataclass(frozen=True)
class EngineSession:
    """What an engine keeps of one trajectory between its turns: ``fed`` positions have been through a
    forward (their routing rows are the trajectory's already); ``state`` is the engine's own (the embedded
    engine's KV cache of those positions; None where the engine keeps nothing)."""

    fed: int
    state: object = None


@dataclass(frozen=True)
class TurnRequest:
    """One turn of one trajectory: generate after ``ids`` (all its tokens so far), continuing ``session``
    (None: the first turn). ``params.n`` is 1 and ``params.seed`` this turn's own, so the tokens drawn do not
    depend on which other trajectories share the engine's batch."""

    ids: list[int]
    params: SamplingParams
    session: EngineSession | None = None

    def __post_init__(self) -> None:
        if self.params.n != 1:
            raise ValueError(f"a turn generates one continuation (params.n=1), got n={self.params.n}")
        fed = self.session.fed if self.session is not None else 0
        if not 0 <= fed <= len(self.ids) - 1:
            raise ValueError(f"a session that fed {fed} positions cannot continue {len(self.ids)} tokens")


@dataclass(frozen=True)
class TurnResult:
    output_ids: list[int]
    output_log_probs: torch.Tensor  # float32 [len(output_ids)], as ``Sample.output_log_probs``
    finish_reason: FinishReason
    weight_version: int  # the weights that produced this turn's tokens (and its new routing rows)
    # int32 [new positions, layers, top_k]: rows of positions session.fed .. len(ids) + len(output) - 2
    # (this call's forwards), None unless asked for
    routed_experts: torch.Tensor | None
    session: EngineSession  # continues the trajectory (fed = len(ids) + len(output_ids) - 1)
    # int32 [request.session.fed, layers, top_k]: this call's rows of the positions an earlier turn fed, where
    # the engine fed the whole context again; None where it fed only the new positions (a kept KV cache)
    earlier_rows: torch.Tensor | None = None


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

    def generate_turns(self, requests: list[TurnRequest]) -> list[TurnResult]:
        """One turn of each trajectory, in request order. This default feeds each request's whole context
        again (an engine's prefix cache may reuse the KV); the routing rows of positions an earlier turn fed
        come back apart (``earlier_rows``): the trajectory keeps those it already has and checks these against
        them. Engines with a per-trajectory cache override it."""
        results = []
        for request in requests:
            (sample,) = self.generate([request.ids], request.params)[0]
            output = list(sample.output_ids)
            rows, earlier = split_rows(sample.routed_experts, request)
            results.append(
                TurnResult(
                    output,
                    sample.output_log_probs,
                    sample.finish_reason,
                    sample.weight_version,
                    rows,
                    EngineSession(len(request.ids) + len(output) - 1),
                    earlier,
                )
            )
        return results

    def session_state(self, session: EngineSession) -> dict:
        """A trajectory's session as plain data (tensors, numbers) for a checkpoint. This default keeps
        ``fed`` only: it keeps no per-trajectory state (its next turn feeds the whole context again)."""
        return {"fed": session.fed}

    def session_from_state(self, state: dict) -> EngineSession:
        """``session_state``'s inverse."""
        return EngineSession(int(state["fed"]))

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


def split_rows(rows: torch.Tensor | None, request: TurnRequest) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A whole-context call's rows -> (the new positions' rows, the rows of the positions an earlier turn fed;
    None on the first turn)."""
    if rows is None:
        return None, None
    fed = request.session.fed if request.session is not None else 0
    return rows[fed:], (rows[:fed] if fed else None)
