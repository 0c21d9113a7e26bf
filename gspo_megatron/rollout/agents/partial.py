"""Over-sampling and partial rollouts (``rollout.over_sample``, ``rollout.partial``): a step no longer waits
for its longest responses (slime's ``--over-sampling-batch-size`` / ``--partial-rollout``, verl's partial
rollout, Megatron-RL's ``--rl-partial-rollouts``).

A step needs G groups (``trainer.prompts_per_step``). It starts ceil(over_sample x G) of them -- the groups
carried from the last step first, then fresh prompts -- and the engine stops generating once G groups are
complete, every sample finished (``RolloutEngine.generate_rows``). The first G complete groups in that
order are the step's batch (carried groups first: the older a group, the sooner it trains). The others:
- ``partial=drop``: discarded, their prompts spent. The batch then leans to short responses, the groups
  that finish first -- the bias ``continue`` removes. (Groups the engine never started -- rows past
  ``rollout.embedded.max_batch_size`` -- are only prompts yet: kept for the next step either way.)
- ``partial=continue``: carried to the next step as they are -- finished samples whole, unfinished ones
  with their tokens, the engine's per-token log-probs and the weight version of each token
  (``Sample.extra["token_versions"]``). The next step feeds an unfinished sample's prompt and tokens to the
  engine, which goes on under the new weights with the budget the sample has left; the sample is the two
  parts stitched. Its tokens then come from several policy versions: the loss weighs them with the
  engine's log-probs like any engine/trainer mismatch (``algorithm.mismatch_*``), and the metrics say how
  many are stale and by how much (``rollout/partial/stale_token_frac``, ``stale_tokens_age_<k>``). A
  carried group holding a token more than ``rollout.max_staleness`` versions old by the step it would
  train in is dropped instead, whole (``rollout/staleness.py:admit_groups``; ``rollout/partial/dropped_stale``).
  A sample's ``weight_version`` is
  its oldest token's.
The carried groups are part of the checkpoint (``state_dict``): a resumed run continues them exactly. A
resume may change ``rollout.group_size`` or ``rollout.max_new_tokens`` (``checkpoint.resume_allow_changes``):
a carried group with more samples than the group size now asks for, or a sample with more tokens than the
budget now allows, would train at the old shape, so it is dropped (its prompt spent, counted in
``rollout/partial/groups_dropped``, with a warning naming the key); a group with fewer samples than the new
size is filled up under the current weights, like any unfinished group.

With an agent (``rollout.agent``, ``draw_trajectories``) a sample is a trajectory, and the cut falls between
turns (``batcher.GroupCut``): once G groups have every trajectory ended, the trajectories still running are
cancelled where they wait, and an unfinished one is carried whole (``carried.py``: its turns, tokens with
their provenance and versions, its routing rows per turn, the engine session that holds its KV cache). The
next step runs its agent again over the recorded turns and continues it on the new weights: each token
keeps the version that sampled it and each position the routing of the forward that computed its KV, so
R3 replays every token's own rows. Its budget is ``rollout.agent.max_tokens``, not ``max_new_tokens``. A
checkpoint holds the sessions as the engine exports them (the embedded engine's KV tensors: a carried
trajectory's KV cache is in the checkpoint).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from gspo_megatron.contracts.samples import (
    TOKEN_VERSIONS,
    FinishReason,
    RowRequest,
    Sample,
    SamplingParams,
    TurnSpan,
)
from gspo_megatron.rollout.agents.carried import (
    CARRIED_TRAJECTORY,
    CarriedTrajectory,
    carried_from_state,
    carried_state,
)
from gspo_megatron.rollout.agents.trajectories import AGENT_STATS, TrajectoryStart, trajectory_seed
from gspo_megatron.rollout.config import PARTIAL_CONTINUE, PartialRollout
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.engine import RolloutEngine
from gspo_megatron.rollout.staleness import admit_groups, stale_token_metrics, token_ages


@dataclass
class Group:
    """One prompt's samples; an unfinished sample has ``FinishReason.ABORT`` and the tokens it has so far."""

    record: PromptRecord
    samples: list[Sample]

    @property
    def complete(self) -> bool:
        return bool(self.samples) and all(finished(sample) for sample in self.samples)


@dataclass
class DrawnGroups:
    """A step's complete groups and what happened to the others."""

    groups: list[Group]
    metrics: dict[str, float]


def finished(sample: Sample | None) -> bool:
    """A sample that needs no more generation: one the engine did not stop, or an agent's ended trajectory
    (its counts in ``extra``: one that failed before its first turn is ``ABORT`` too, and trains as it is)."""
    return sample is not None and (sample.finish_reason != FinishReason.ABORT or AGENT_STATS in sample.extra)


def token_versions(sample: Sample) -> list[int]:
    """The weight version of each output token (a sample of one engine call: all its ``weight_version``)."""
    return list(sample.extra.get(TOKEN_VERSIONS, [sample.weight_version] * len(sample.output_ids)))


def stitch(earlier: Sample | None, prompt: list[int], new: Sample, version: int) -> Sample:
    """``earlier``'s tokens (None: nothing yet) followed by ``new``, the engine's continuation of them
    (its input was ``prompt`` + earlier's tokens). Routed experts are the continuation's: it fed every token
    but the last again, under the current weights. The continuation's tokens are ``version``'s, unless the call
    took an in-flight update (``EmbeddedEngine.request_update``): then they keep the versions it lists."""
    before = earlier.output_ids if earlier is not None else []
    continued = new.extra.get(TOKEN_VERSIONS, [version] * len(new.output_ids))
    versions = (token_versions(earlier) if earlier is not None else []) + list(continued)
    log_probs = earlier.output_log_probs if earlier is not None else torch.zeros(0)
    return Sample(
        prompt_ids=list(prompt),
        output_ids=list(before) + list(new.output_ids),
        output_log_probs=torch.cat([log_probs.float(), new.output_log_probs.float()]),
        finish_reason=new.finish_reason,
        routed_experts=new.routed_experts,
        weight_version=min(versions, default=version),
        extra={**new.extra, TOKEN_VERSIONS: versions},
    )


class PartialRollouts:
    """The driver's over-sampling state: the groups carried between steps (``partial=continue``)."""

    def __init__(
        self,
        over_sample: float,
        partial: PartialRollout,
        max_staleness: int,
        engine: RolloutEngine | None = None,
        budget: tuple[str, int] | None = None,
    ):
        """``engine``: exports and imports carried trajectories' sessions for a checkpoint (agents only);
        ``budget``: the key and the most tokens a sample may hold (default ``rollout.max_new_tokens``;
        ``rollout.agent.max_tokens`` for trajectories)."""
        if not (math.isfinite(over_sample) and over_sample >= 1.0):
            raise ValueError(f"rollout.over_sample={over_sample} must be >= 1 (1: no over-sampling)")
        self.over_sample = over_sample
        self.partial = PartialRollout(partial)
        self.max_staleness = max_staleness
        self.carried: list[Group] = []
        self.engine, self.budget = engine, budget

    def draw(
        self,
        needed: int,
        next_records: Callable[[int], list[PromptRecord]],
        generate_rows: Callable[[list[RowRequest], SamplingParams, int], list[Sample]],
        params: SamplingParams,
        version: int,
    ) -> DrawnGroups:
        """``needed`` complete groups of ``params.n`` samples, generated on weight version ``version``."""
        groups, carried, dropped, already = self._start(needed, next_records, params, version)
        rows, places = self._rows(groups, params)
        generated = generate_rows(rows, replace(params, n=1), needed - already) if already < needed else []
        for (group_index, sample_index), new in zip(places, generated, strict=True):
            group = groups[group_index]
            earlier = group.samples[sample_index] if sample_index < len(group.samples) else None
            _place(group, sample_index, stitch(earlier, list(group.record.prompt_ids or ()), new, version))
        return self._settle(groups, needed, carried, dropped, generated, version)

    def draw_trajectories(
        self,
        needed: int,
        next_records: Callable[[int], list[PromptRecord]],
        generate_until: Callable[
            [list[TrajectoryStart], list[int], SamplingParams, int], list[Sample | CarriedTrajectory | None]
        ],
        params: SamplingParams,
        version: int,
    ) -> DrawnGroups:
        """``draw`` with an agent (module docstring): ``generate_until`` is ``TrajectoryRunner.generate_until``;
        a fresh trajectory's seed is ``trajectory_seed`` of its place (group x n + sample), a carried one keeps
        its own."""
        groups, carried, dropped, already = self._start(needed, next_records, params, version)
        starts, places = [], []
        for group_index, group in enumerate(groups):
            for sample_index in range(params.n):
                sample = group.samples[sample_index] if sample_index < len(group.samples) else None
                if finished(sample):
                    continue
                kept = sample.extra.get(CARRIED_TRAJECTORY) if sample is not None else None
                seed = kept.seed if kept is not None else trajectory_seed(params, group_index * params.n + sample_index)
                starts.append(TrajectoryStart(group.record, seed, kept))
                places.append((group_index, sample_index))
        outcomes = (
            generate_until(starts, [g for g, _ in places], replace(params, n=1), needed - already)
            if already < needed
            else []
        )
        generated, added = [], 0
        for (group_index, sample_index), start, outcome in zip(places, starts, outcomes, strict=True):
            sample = _unfinished_sample(start, outcome) if not isinstance(outcome, Sample) else outcome
            _place(groups[group_index], sample_index, sample)
            generated.append(sample)
            added += len(sample.output_ids) - (start.carried.generated_end if start.carried is not None else 0)
        drawn = self._settle(groups, needed, carried, dropped, generated, version)
        # the tokens this step added (a continued trajectory's recorded ones are not generated again)
        drawn.metrics["rollout/partial/generated_tokens"] = float(added)
        return drawn

    def _start(
        self, needed: int, next_records: Callable[[int], list[PromptRecord]], params: SamplingParams, version: int
    ) -> tuple[list[Group], list[Group], int, int]:
        """The groups this step starts (carried ones still admissible, then fresh prompts), the carried ones,
        how many carried ones were dropped, and how many of them are complete already."""
        carried, dropped_stale = self._still_fresh(version)
        key, budget = self.budget or ("rollout.max_new_tokens", params.max_new_tokens)
        carried, dropped_misfit = _fitting(carried, params.n, key, budget)
        already = sum(group.complete for group in carried)
        started = math.ceil(self.over_sample * needed)
        # no fresh prompts when the carried groups complete the step already
        fresh = next_records(started - len(carried)) if started > len(carried) and already < needed else []
        return carried + [Group(record, []) for record in fresh], carried, dropped_stale + dropped_misfit, already

    def _settle(
        self,
        groups: list[Group],
        needed: int,
        carried: list[Group],
        dropped: int,
        generated: list[Sample],
        version: int,
    ) -> DrawnGroups:
        """The first ``needed`` complete groups are the step's; the rest carried (``continue``) or dropped."""
        complete = [group for group in groups if group.complete]
        if len(complete) < needed:
            raise RuntimeError(
                f"the engine stopped with {len(complete)} complete groups of the {needed} asked for "
                f"({len(groups)} started)"
            )
        taken = complete[:needed]
        taken_ids = {id(group) for group in taken}  # identity: groups hold tensors, == would compare them
        rest = [group for group in groups if id(group) not in taken_ids]
        # groups not started yet are prompts still to generate, carried either way (nothing of them is stale)
        self.carried = [group for group in rest if self.partial == PARTIAL_CONTINUE or not _started(group)]
        metrics = self._metrics(groups, taken, carried, dropped, generated, version)
        return DrawnGroups(taken, metrics)

    def _still_fresh(self, version: int) -> tuple[list[Group], int]:
        """The carried groups whose oldest token is at most ``max_staleness`` versions old at ``version``
        (``rollout/staleness.py:admit_groups``: a group whole, by its oldest token)."""
        admission = admit_groups(self.carried, _group_token_versions, version, self.max_staleness)
        return admission.admitted, len(admission.dropped)

    @staticmethod
    def _rows(groups: list[Group], params: SamplingParams) -> tuple[list[RowRequest], list[tuple[int, int]]]:
        """A row for every unfinished or unstarted sample, and the (group, sample) it fills."""
        rows, places = [], []
        for group_index, group in enumerate(groups):
            prompt = list(group.record.prompt_ids or ())
            for sample_index in range(params.n):
                sample = group.samples[sample_index] if sample_index < len(group.samples) else None
                if finished(sample):
                    continue
                so_far = sample.output_ids if sample is not None else []
                rows.append(RowRequest(prompt + list(so_far), params.max_new_tokens - len(so_far), group_index))
                places.append((group_index, sample_index))
        return rows, places

    def _metrics(
        self,
        groups: list[Group],
        taken: list[Group],
        carried: list[Group],
        dropped_stale: int,
        generated: list[Sample],
        version: int,
    ) -> dict[str, float]:
        ages = token_ages((v for group in taken for v in _group_token_versions(group)), version)
        return {
            "rollout/partial/groups_started": float(len(groups)),
            "rollout/partial/groups_carried_in": float(len(carried)),
            "rollout/partial/groups_carried_out": float(len(self.carried)),
            "rollout/partial/groups_dropped": float(len(groups) - len(taken) - len(self.carried) + dropped_stale),
            "rollout/partial/dropped_stale": float(dropped_stale),
            # stopped with tokens / never started (a later chunk of rows than rollout.embedded.max_batch_size)
            "rollout/partial/aborted_samples": float(sum(not finished(s) and len(s.output_ids) > 0 for s in generated)),
            "rollout/partial/unstarted_samples": float(sum(not finished(s) and not s.output_ids for s in generated)),
            "rollout/partial/generated_tokens": float(sum(len(s.output_ids) for s in generated)),
            **stale_token_metrics(ages, self.max_staleness, "rollout/partial/"),
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"carried": [_group_state(group, self._session_state) for group in self.carried]}

    def load_state_dict(self, state: dict) -> None:
        self.carried = [_group_from_state(group, self._session_from_state) for group in state.get("carried", [])]

    def _session_state(self, carried: CarriedTrajectory) -> dict:
        if self.engine is None:
            raise RuntimeError("a carried trajectory's session is saved by its engine: PartialRollouts(engine=...)")
        return carried_state(carried, self.engine.session_state(carried.session))

    def _session_from_state(self, state: dict) -> CarriedTrajectory:
        if self.engine is None:
            raise RuntimeError("a carried trajectory's session is loaded by its engine: PartialRollouts(engine=...)")
        return carried_from_state(state, self.engine.session_from_state(state["session"]))


def _fitting(groups: list[Group], group_size: int, key: str, budget: int) -> tuple[list[Group], int]:
    """The carried groups that fit ``group_size`` and ``budget`` (the module docstring's rule for a resume with
    changed rollout settings), and how many did not; a warning names the key for those that did not."""
    too_many = [len(g.samples) > group_size for g in groups]
    too_long = [any(len(s.output_ids) > budget for s in g.samples) for g in groups]
    for count, what in (
        (sum(too_many), f"more samples than rollout.group_size={group_size}"),
        (sum(long and not many for long, many in zip(too_long, too_many, strict=True)),
         f"a sample longer than {key}={budget}"),
    ):  # fmt: skip
        if count:
            warnings.warn(
                f"{count} carried group(s) have {what} (the settings changed on resume): dropped, not trained at "
                "their old shape",
                RuntimeWarning,
                stacklevel=3,
            )
    keep = [g for g, many, long in zip(groups, too_many, too_long, strict=True) if not (many or long)]
    return keep, len(groups) - len(keep)


def _place(group: Group, index: int, sample: Sample) -> None:
    """Sample ``index`` of ``group`` is ``sample`` (a group's samples fill in order: one row per sample)."""
    if index < len(group.samples):
        group.samples[index] = sample
    else:
        group.samples.append(sample)


def _unfinished_sample(start: TrajectoryStart, carried: CarriedTrajectory | None) -> Sample:
    """A cut trajectory as a group's unfinished sample: its generated tokens so far (what staleness and the
    budget are judged by) and, in ``extra``, all it carries (None: cut before its first turn, a fresh start)."""
    if carried is None:
        return Sample(list(start.record.prompt_ids or ()), [], torch.zeros(0), FinishReason.ABORT)
    end = carried.generated_end
    return Sample(
        prompt_ids=list(carried.prompt_ids),
        output_ids=carried.output_ids[:end],
        output_log_probs=torch.tensor(carried.log_probs[:end], dtype=torch.float32),
        finish_reason=FinishReason.ABORT,
        weight_version=min(carried.versions[:end], default=0),
        extra={TOKEN_VERSIONS: carried.versions[:end], CARRIED_TRAJECTORY: carried},
    )


def _group_token_versions(group: Group) -> list[int]:
    return [v for sample in group.samples for v in token_versions(sample)]


def _started(group: Group) -> bool:
    return any(sample.output_ids for sample in group.samples)


def _group_state(group: Group, save_carried: Callable[[CarriedTrajectory], dict]) -> dict:
    record = group.record
    return {
        "record": {
            "prompt": record.prompt,
            "answer": record.answer,
            "metadata": dict(record.metadata),
            "prompt_ids": list(record.prompt_ids) if record.prompt_ids is not None else None,
        },
        "samples": [_sample_state(sample, save_carried) for sample in group.samples],
    }


def _sample_state(sample: Sample, save_carried: Callable[[CarriedTrajectory], dict]) -> dict:
    carried = sample.extra.get(CARRIED_TRAJECTORY)
    return {
        "carried": save_carried(carried) if carried is not None else None,
        "prompt_ids": list(sample.prompt_ids),
        "output_ids": list(sample.output_ids),
        "output_log_probs": sample.output_log_probs.clone(),
        "finish_reason": sample.finish_reason.value,
        "routed_experts": sample.routed_experts,
        "weight_version": sample.weight_version,
        "token_versions": token_versions(sample),
        # a trajectory's: which tokens were inserted, its turns, its counts
        "inserted_mask": sample.inserted_mask,
        "turns": [[t.start, t.end, t.weight_version] for t in sample.turns] if sample.turns is not None else None,
        "agent": sample.extra.get(AGENT_STATS),
    }


def _group_from_state(state: dict, load_carried: Callable[[dict], CarriedTrajectory]) -> Group:
    record = state["record"]
    prompt_ids = record["prompt_ids"]
    return Group(
        PromptRecord(
            record["prompt"],
            record["answer"],
            dict(record["metadata"]),
            tuple(prompt_ids) if prompt_ids is not None else None,
        ),
        [
            Sample(
                prompt_ids=list(sample["prompt_ids"]),
                output_ids=list(sample["output_ids"]),
                output_log_probs=sample["output_log_probs"],
                finish_reason=FinishReason(sample["finish_reason"]),
                routed_experts=sample["routed_experts"],
                weight_version=int(sample["weight_version"]),
                extra={
                    TOKEN_VERSIONS: list(sample["token_versions"]),
                    **({CARRIED_TRAJECTORY: load_carried(sample["carried"])} if sample.get("carried") else {}),
                    **({AGENT_STATS: sample["agent"]} if sample.get("agent") is not None else {}),
                },
                inserted_mask=sample.get("inserted_mask"),
                turns=[TurnSpan(*map(int, span)) for span in sample["turns"]]
                if sample.get("turns") is not None
                else None,
            )
            for sample in state["samples"]
        ],
    )
