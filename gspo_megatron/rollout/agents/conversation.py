"""One trajectory's tokens, built turn by turn with each token's provenance: what an agent holds.

    conversation = Conversation(prompt_ids, turns, seed)
    turn = await conversation.generate(params)       # the model's next turn (generated tokens)
    conversation.insert(ids)                         # a tool's answer and the template around it
    sample = conversation.sample()                   # the whole trajectory as one ``Sample``

Design decisions:
- Token in, token out: the conversation's ids are the prompt, each turn's generated ids exactly as the
  engine returned them, and the inserted ids (``templates.py`` renders only those). The next turn's input
  is those ids; nothing is decoded and re-encoded on the way.
- Provenance per output token: generated (its sampling log-prob, the weight version that drew it) or
  inserted (log-prob 0.0, ``Sample.inserted_mask``: never in the loss, never compared with the trainer).
- Routing rows are spliced per turn and never overwritten: the engine returns the rows of the positions a
  turn fed (``TurnResult.routed_experts`` from its session's ``fed``), which are appended; a position's row is
  the forward's that computed its KV -- a generated token's own decode step, and, for a turn's last
  generated token and every inserted token, the next turn's prefill. A row for a position already held is
  a bug (``RoutingSpliceError``), not something to take.
- Across weight versions: one trainer forward replays one row per position, so a trajectory is exact only if
  every later token was computed from the KV whose rows it holds. An engine that feeds the whole context
  each turn (SGLang) returns its rows of the earlier positions too (``TurnResult.earlier_rows``), equal to the
  held ones where its prefix cache served that KV. Where they differ, the engine computed those positions
  again: under other weights than first computed them (a flushed cache after a weight update:
  ``rollout.sglang.pause_mode=retract``), the new turn would train on KV the trainer cannot replay, so the
  turn is refused (``RoutingVersionError``, naming ``pause_mode=in_place``; the trajectory ends at its last
  exact turn); under the same weights (the cache evicted it, or never kept it) the held rows stay and the
  positions are counted (``rerouted_positions``: ``agent/rerouted_positions``).
- A trajectory ends after its last generated token: inserted tokens after it (a tool's answer when the turn
  limit stopped the trajectory) would train nothing and have no routing row, so ``sample`` leaves them out.
- A trajectory cut at a step's end (``rollout.over_sample`` with an agent) is ``carried()`` and continued by a
  conversation built with ``carried=``: its recorded turns answered from the record, the first new one on the
  engine session it left (``carried.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import torch

from gspo_megatron.contracts.samples import TOKEN_VERSIONS, FinishReason, Sample, SamplingParams, TurnSpan
from gspo_megatron.rollout.agents.carried import CarriedTrajectory, ReplayDivergedError
from gspo_megatron.rollout.engine import EngineSession, TurnRequest, TurnResult

_TURN_SEED_STRIDE = 7_919  # a turn's seed: the trajectory's plus the turn's index times this


class RoutingSpliceError(RuntimeError):
    """An engine returned routing rows that do not continue the trajectory's (a position would get two)."""


class RoutingVersionError(RoutingSpliceError):
    """A turn was computed over earlier positions that the engine computed again under other weights."""


class TurnLimitError(RuntimeError):
    """An agent asked for a turn past ``rollout.agent.max_turns``."""


class Conversation:
    def __init__(
        self,
        prompt_ids: list[int],
        turns: Callable[[TurnRequest], Awaitable[TurnResult]],
        seed: int,
        max_turns: int | None = None,
        carried: CarriedTrajectory | None = None,
    ):
        """``turns``: submits one turn to the engine (``batcher.TurnBatcher.generate``); ``seed``: the
        trajectory's, from which each turn's own is drawn (so its tokens do not depend on batching);
        ``max_turns``: the most turns any agent gets (``rollout.agent.max_turns``; None: no limit);
        ``carried``: the turns an earlier step recorded, answered from the record (module docstring)."""
        if carried is not None and (list(prompt_ids) != carried.prompt_ids or seed != carried.seed):
            raise ValueError("a carried trajectory continues with its own prompt and seed")
        if not prompt_ids:
            raise ValueError("a conversation needs a prompt of at least one token")
        self.prompt_ids = list(prompt_ids)
        self._turns, self.seed, self.max_turns = turns, seed, max_turns
        self.output_ids: list[int] = []
        self.log_probs: list[float] = []
        self.inserted: list[bool] = []
        self.versions: list[int] = []  # per output token: the weights that drew it (inserted: the turn before)
        self.spans: list[TurnSpan] = []
        self.routing: list[torch.Tensor] = []  # rows of positions 0 .. fed - 1, turn by turn
        self.routing_versions: list[int] = []  # per entry of ``routing``: the weights that computed its KV
        self.rerouted_positions = 0  # held positions an engine computed again, same weights, other experts
        self.session: EngineSession | None = None
        self.finish = FinishReason.STOP
        self.turn_finishes: list[FinishReason] = []
        self._replay = carried

    def restart(self, prompt_ids: list[int]) -> None:
        """A different prompt, before the first turn (an endpoint's client renders its own first messages)."""
        if self.output_ids or self.session is not None:
            raise RuntimeError("a conversation's prompt cannot change after its first turn")
        if not prompt_ids:
            raise ValueError("a conversation needs a prompt of at least one token")
        self.prompt_ids = list(prompt_ids)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def fed(self) -> int:
        """Positions that have been through the engine (their routing rows are held)."""
        return self.session.fed if self.session is not None else 0

    async def generate(self, params: SamplingParams) -> TurnResult:
        """The model's next turn after everything so far; its tokens are appended as generated."""
        if self.max_turns is not None and len(self.spans) >= self.max_turns:
            raise TurnLimitError(f"the trajectory has had its {self.max_turns} turns (rollout.agent.max_turns)")
        if self.replaying:
            return self._recorded_turn()
        seed = (self.seed + _TURN_SEED_STRIDE * len(self.spans)) % (2**31 - 1)
        request = TurnRequest(self.ids, dataclasses.replace(params, n=1, seed=seed), self.session)
        result = await self._turns(request)
        self._splice(result)
        start = len(self.output_ids)
        self.output_ids += result.output_ids
        self.log_probs += result.output_log_probs.tolist()
        self.inserted += [False] * len(result.output_ids)
        self.versions += [result.weight_version] * len(result.output_ids)
        self.spans.append(TurnSpan(start, len(self.output_ids), result.weight_version))
        self.session, self.finish = result.session, result.finish_reason
        self.turn_finishes.append(result.finish_reason)
        return result

    @property
    def replaying(self) -> bool:
        """Whether the next turn is one a carried trajectory recorded."""
        return self._replay is not None and len(self.spans) < len(self._replay.spans)

    def _recorded_turn(self) -> TurnResult:
        """The carried trajectory's next recorded turn, as the engine returned it then -- only after exactly
        the tokens it was sampled after (``ReplayDivergedError`` otherwise: ``carried.py``)."""
        assert self._replay is not None
        carried, index = self._replay, len(self.spans)
        tokens, rows = carried.turn(index)
        if self.output_ids != carried.output_ids[: tokens.start]:
            self._adopt(carried)  # the trajectory as recorded: every turn of it sampled after its own tokens
            raise ReplayDivergedError(
                f"the agent, run again on a carried trajectory, asked for its turn {index} after other tokens than "
                "the turn was sampled after (an agent or tool that does not answer the same way twice): the "
                "trajectory ends at its recorded turns"
            )
        output = carried.output_ids[tokens]
        self.output_ids += output
        self.log_probs += carried.log_probs[tokens]
        self.inserted += carried.inserted[tokens]
        self.versions += carried.versions[tokens]
        self.spans.append(carried.spans[index])
        if rows is not None:
            self.routing.append(rows)
            self.routing_versions.append(carried.routing_versions[index])
        last = index == len(carried.spans) - 1  # the engine's session continues after the last recorded turn
        self.session = carried.session if last else EngineSession(len(self.ids) - 1)
        self.finish = carried.turn_finishes[index]
        self.turn_finishes.append(self.finish)
        return TurnResult(
            output,
            torch.tensor(carried.log_probs[tokens], dtype=torch.float32),
            self.finish,
            carried.spans[index].weight_version,
            rows,
            self.session,
        )

    def _adopt(self, carried: CarriedTrajectory) -> None:
        """Every recorded turn of ``carried``, as recorded (nothing more is asked of the engine after it)."""
        self.output_ids, self.log_probs = list(carried.output_ids), list(carried.log_probs)
        self.inserted, self.versions = list(carried.inserted), list(carried.versions)
        self.spans, self.turn_finishes = list(carried.spans), list(carried.turn_finishes)
        self.routing, self.routing_versions = list(carried.routing), list(carried.routing_versions)
        self.session, self.finish = carried.session, carried.turn_finishes[-1]

    def carried(self) -> CarriedTrajectory:
        """Everything so far, to continue in a later step (a conversation still answering a carried
        trajectory's recorded turns carries that trajectory whole: nothing of it is lost)."""
        if self._replay is not None and self.replaying:
            return self._replay
        return CarriedTrajectory(
            prompt_ids=list(self.prompt_ids),
            seed=self.seed,
            output_ids=list(self.output_ids),
            log_probs=list(self.log_probs),
            inserted=list(self.inserted),
            versions=list(self.versions),
            spans=list(self.spans),
            turn_finishes=list(self.turn_finishes),
            routing=list(self.routing),
            routing_versions=list(self.routing_versions),
            session=self.session if self.session is not None else EngineSession(0),
        )

    def insert(self, ids: list[int]) -> None:
        """Tokens the model did not sample (a tool's answer, the template around it)."""
        self.output_ids += ids
        self.log_probs += [0.0] * len(ids)
        self.inserted += [True] * len(ids)
        self.versions += [self.spans[-1].weight_version if self.spans else 0] * len(ids)

    def text_of(self, turn: int, decode: Callable[[list[int]], str]) -> str:
        span = self.spans[turn]
        return decode(self.output_ids[span.start : span.end])

    def _splice(self, result: TurnResult) -> None:
        if result.routed_experts is None:
            if self.routing:
                raise RoutingSpliceError("a turn returned no routing rows where the earlier turns did")
            return
        expected = result.session.fed - self.fed
        if result.routed_experts.shape[0] != expected:
            raise RoutingSpliceError(
                f"a turn fed positions {self.fed}..{result.session.fed - 1} ({expected} rows) but the engine "
                f"returned {result.routed_experts.shape[0]} routing rows"
            )
        if result.earlier_rows is not None:
            self._check_earlier_rows(result.earlier_rows, result.weight_version)
        self.routing.append(result.routed_experts)
        self.routing_versions.append(result.weight_version)

    def _check_earlier_rows(self, earlier: torch.Tensor, version: int) -> None:
        """The engine's rows of the held positions against the held ones (module docstring: equal where its
        cache served their KV; a difference under other weights refuses the turn, under the same is counted)."""
        held = torch.cat(self.routing) if self.routing else earlier[:0]
        if earlier.shape != held.shape:
            raise RoutingSpliceError(
                f"the engine returned {tuple(earlier.shape)} rows for the {held.shape[0]} positions already held "
                f"(rows {tuple(held.shape)})"
            )
        differs = (earlier != held).flatten(1).any(dim=1)
        if not bool(differs.any()):
            return
        computed_under = torch.cat(
            [torch.full((rows.shape[0],), v) for rows, v in zip(self.routing, self.routing_versions, strict=True)]
        )
        other = differs & (computed_under != version)
        if bool(other.any()):
            first = int(other.nonzero()[0])
            raise RoutingVersionError(
                f"weight version {version}'s turn was computed over {int(other.sum())} earlier positions (the first: "
                f"{first}, held from version {int(computed_under[first])}) that the engine computed again under its "
                f"new weights, routed otherwise: their KV was dropped at the weight update, so one routing per "
                f"position cannot replay this trajectory. With SGLang set rollout.sglang.pause_mode=in_place (no "
                f"cache flush at an update: the prefix cache keeps the KV and the routing computed with it)"
            )
        self.rerouted_positions += int(differs.sum())

    def sample(self) -> Sample:
        """The trajectory up to its last generated token (module docstring), as one ``Sample``."""
        end = self.spans[-1].end if self.spans else 0
        routed = None
        if self.routing:
            rows = len(self.prompt_ids) + end - 1
            routed = torch.cat(self.routing)[:rows]
            if routed.shape[0] != rows:
                raise RoutingSpliceError(
                    f"{routed.shape[0]} routing rows held for a trajectory of {rows} fed positions"
                )
        return Sample(
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids[:end],
            output_log_probs=torch.tensor(self.log_probs[:end], dtype=torch.float32),
            finish_reason=self.finish,
            routed_experts=routed,
            weight_version=min(self.versions[:end], default=0),
            extra={TOKEN_VERSIONS: self.versions[:end]},
            inserted_mask=torch.tensor(self.inserted[:end], dtype=torch.bool),
            turns=list(self.spans),
        )
