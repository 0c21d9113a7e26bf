"""A trajectory whose next turn waits for the next step (``rollout.over_sample`` with an agent): what it
carries, and how it continues.

    carried = conversation.carried()               # at the step's cut: its turns so far, exactly
    conversation = Conversation(..., carried=carried)   # next step: the agent runs again from the start
    sample = conversation.sample()                 # the recorded turns, then the new ones

Design decisions:
- The agent is run again from its start, and its recorded turns are answered from the record, not the
  engine (``Conversation.generate``): an agent is any async function, whose locals and tools' state no
  checkpoint can hold, but which is a function of the turns it is answered with. Its tools are built anew and
  called again with the same arguments (so a tool's per-trajectory state is rebuilt the way it was built);
  each recorded turn is answered only if the agent asks for it after exactly the recorded tokens (the tools'
  answers inserted between turns included); otherwise ``ReplayDivergedError`` ends the trajectory at its
  last recorded turn, counted in ``agent/errors`` -- never a turn over tokens other than those it was sampled
  after. A tool with effects outside the trajectory sees its calls twice.
- A recorded turn keeps its tokens, log-probs, weight version and routing rows as they were; the first new
  turn continues the engine session (the embedded engine's KV cache of the fed positions, computed under the
  weights live then), so every position keeps the routing of the forward that computed its KV and each
  token records the version that sampled it (``docs/agents.md``, "Routing Replay across turns and weight
  versions").
- A checkpoint holds the session as the engine exports it (``RolloutEngine.session_state``: the embedded
  engine's KV tensors), so a resumed run continues on the very KV, not on one computed again under newer
  weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo_megatron.contracts.samples import FinishReason, TurnSpan
from gspo_megatron.rollout.engine import EngineSession

CARRIED_TRAJECTORY = "carried_trajectory"  # Sample.extra of an unfinished trajectory: its CarriedTrajectory


class ReplayDivergedError(RuntimeError):
    """A carried trajectory's agent, run again, asked for a recorded turn after other tokens than recorded."""


@dataclass(frozen=True)
class CarriedTrajectory:
    """One trajectory's turns so far (``Conversation``'s fields, per output token and per turn)."""

    prompt_ids: list[int]
    seed: int
    output_ids: list[int]  # generated and inserted, up to the cut (tool answers after the last turn included)
    log_probs: list[float]
    inserted: list[bool]
    versions: list[int]  # per output token: the weights that sampled it
    spans: list[TurnSpan]
    turn_finishes: list[FinishReason]
    routing: list[torch.Tensor]  # per turn: the rows of the positions its engine call fed (none: no R3)
    routing_versions: list[int]
    session: EngineSession  # after the last turn: continues on the engine (its KV cache)

    @property
    def generated_end(self) -> int:
        """The output tokens up to the last generated one (what a sample of it holds)."""
        return self.spans[-1].end if self.spans else 0

    def turn(self, index: int) -> tuple[slice, torch.Tensor | None]:
        """Turn ``index``'s output tokens and its routing rows (None without routing)."""
        span = self.spans[index]
        return slice(span.start, span.end), (self.routing[index] if self.routing else None)


def carried_state(carried: CarriedTrajectory, session_state: dict) -> dict:
    """Plain data (tensors, lists, numbers) for a checkpoint; ``session_state`` is the engine's export of
    ``carried.session`` (``RolloutEngine.session_state``)."""
    return {
        "prompt_ids": list(carried.prompt_ids),
        "seed": carried.seed,
        "output_ids": list(carried.output_ids),
        "log_probs": torch.tensor(carried.log_probs, dtype=torch.float32),
        "inserted": list(carried.inserted),
        "versions": list(carried.versions),
        "spans": [[span.start, span.end, span.weight_version] for span in carried.spans],
        "turn_finishes": [finish.value for finish in carried.turn_finishes],
        "routing": list(carried.routing),
        "routing_versions": list(carried.routing_versions),
        "session": session_state,
    }


def carried_from_state(state: dict, session: EngineSession) -> CarriedTrajectory:
    """``carried_state``'s inverse; ``session`` is the engine's import of ``state["session"]``."""
    return CarriedTrajectory(
        prompt_ids=list(state["prompt_ids"]),
        seed=int(state["seed"]),
        output_ids=list(state["output_ids"]),
        log_probs=[float(v) for v in state["log_probs"].tolist()],
        inserted=[bool(v) for v in state["inserted"]],
        versions=[int(v) for v in state["versions"]],
        spans=[TurnSpan(int(start), int(end), int(version)) for start, end, version in state["spans"]],
        turn_finishes=[FinishReason(value) for value in state["turn_finishes"]],
        routing=list(state["routing"]),
        routing_versions=[int(v) for v in state["routing_versions"]],
        session=session,
    )
