"""The producer's last step: a step's samples as one padded ``RolloutBatch`` (``contracts/batch.py``),
with masks aligned to the targets."""

from __future__ import annotations

import torch

from gspo_megatron.contracts.batch import RolloutBatch
from gspo_megatron.contracts.samples import Sample


def pack_samples(
    samples: list[Sample],
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    shaped_rewards: torch.Tensor,
    pad_token_id: int,
    with_routed_experts: bool = False,
    train_on_exit_tokens: bool = False,
    token_advantage_terms: list[torch.Tensor] | None = None,
) -> RolloutBatch:
    """Right-pad prompt+response token ids into one batch, with masks aligned to the targets.

    Row i holds prompt p_i then response r_i. Target index j scores token j+1, so the response's
    targets are j in [p_i - 1, p_i + r_i - 1) and the fed inputs are j < p_i + r_i - 1 (the last
    token is never fed; SGLang's routed rows alike). Built from one flat tensor per field and
    position masks, not per-row copies: the main job packs 256 rows a step.

    ``token_advantage_terms`` (per-turn rewards, ``rollout/agents/turn_rewards.py``): float [len(output_ids)]
    per sample, added to its advantage on its response targets; the advantages are then [N, S-1] (aligned to
    the targets, A_i elsewhere). None: one advantage per row, [N].
    """
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    n = len(samples)
    prompt_lengths = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    response_lengths = torch.tensor([len(s.output_ids) for s in samples], dtype=torch.long)
    lengths = prompt_lengths + response_lengths
    width = int(lengths.max())
    position = torch.arange(width)
    real = position < lengths[:, None]  # [n, S]
    tokens = torch.full((n, width), pad_token_id, dtype=torch.long)
    tokens[real] = torch.tensor([t for s in samples for ids in (s.prompt_ids, s.output_ids) for t in ids])
    target = position[: width - 1]
    fed = target < (lengths - 1)[:, None]  # [n, S-1]
    response = fed & (target >= (prompt_lengths - 1)[:, None])
    rollout_logp = torch.zeros(n, width - 1)
    rollout_logp[response] = torch.cat([s.output_log_probs.float() for s in samples])
    sampled = response.float()
    inserted = torch.zeros_like(sampled)  # what an agent inserted (tool answers, template): never trained
    for i, sample in enumerate(samples):
        p, r = len(sample.prompt_ids), len(sample.output_ids)
        if sample.truncation is not None:
            # tokens the truncated rollout inserted (closing the thinking block) were not sampled by the
            # policy: never compared with the engine's log-probs (it reports 0.0 for them), and trained on
            # only when rollout.truncation.train_on_exit_tokens (the exit decision then gets gradient)
            sampled[i, p - 1 : p + r - 1] *= 1.0 - sample.truncation.forced_mask.float()
        if sample.inserted_mask is not None:
            inserted[i, p - 1 : p + r - 1] = sample.inserted_mask.float()
    sampled = sampled * (1.0 - inserted)
    mask = response.float() * (1.0 - inserted) if train_on_exit_tokens else sampled
    routed = None
    if with_routed_experts:
        routed = _routed_experts(samples, fed)
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        input_mask=fed.float(),
        rollout_log_probs=rollout_logp,
        sampled_mask=sampled,
        advantages=_token_advantages(advantages.float(), response, token_advantage_terms),
        rewards=rewards.float(),
        shaped_rewards=shaped_rewards.float(),
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        routed_experts=routed,
        policy_versions=torch.tensor([s.weight_version for s in samples], dtype=torch.long),
        input_turns=_input_turns(samples, width) if any(s.turns is not None for s in samples) else None,
    )


def _token_advantages(
    advantages: torch.Tensor, response: torch.Tensor, terms: list[torch.Tensor] | None
) -> torch.Tensor:
    """[N] as given, or with ``terms``: [N, S-1] = A_i everywhere, plus each output token's term at its target."""
    if terms is None:
        return advantages
    per_token = advantages[:, None].expand(response.shape).clone()
    per_token[response] += torch.cat([term.float() for term in terms])  # row-major: each row's outputs in order
    return per_token


def _routed_experts(samples: list[Sample], fed: torch.Tensor) -> torch.Tensor:
    """int32 [n, S-1, layers, k]: each fed position's experts as the engine returned them. Padding, and the
    prompt of a trajectory that ended before its first turn (no engine call fed it: ``turns == []``, no tokens
    to train; ``_input_turns`` tags it -1 so no diagnostic compares it), route to experts 0..k-1: a valid top-k
    (k distinct experts), which megatron's token dispatch needs even for tokens the loss ignores (0.19.2's
    alltoall dispatcher fails on [0, 0]: it counts a token's expert slots, not its distinct experts)."""
    for sample in samples:
        if sample.routed_experts is None and sample.turns != []:
            raise ValueError(
                "rollout routing replay needs routed experts from the engine, but a sample has none; "
                "the engine must be asked with return_routed_experts"
            )
    given = [sample.routed_experts for sample in samples if sample.routed_experts is not None]
    if not given:
        raise ValueError(
            f"every one of the step's {len(samples)} trajectories ended before its first turn (the warning above "
            "names the first error): no routing to replay and no token to train"
        )
    layers, k = given[0].shape[1:]
    filler = torch.arange(k, dtype=torch.int32)
    routed = filler.expand(*fed.shape, layers, k).clone()
    fed_counts = fed.sum(dim=1).tolist()
    rows = [
        filler.expand(count, layers, k) if sample.routed_experts is None else sample.routed_experts.to(torch.int32)
        for sample, count in zip(samples, fed_counts, strict=True)
    ]
    routed[fed] = torch.cat(rows)  # row-major: each row's fed tokens in order
    return routed


def _input_turns(samples: list[Sample], width: int) -> torch.Tensor:
    """long [n, S-1]: the turn whose engine call fed each input position of a multi-turn trajectory, -1 where
    none did (padding; a trajectory that ended before its first turn, ``turns == []``). Turn t's call feeds,
    in its prefill, every position from the last generated token of turn t-1 (the prompt for turn 0) through
    the inserted tokens after it, then, decoding, its own generated tokens but the last: position j belongs
    to the number of turns whose last generated token lies at or before j. The log-prob of target j+1 comes
    from the same forward, so the tokens a turn generated are the targets of its positions. A sample without
    turns (``None``) is one turn."""
    turns = torch.full((len(samples), width - 1), -1, dtype=torch.long)
    for i, sample in enumerate(samples):
        if sample.turns == []:
            continue
        p, fed = len(sample.prompt_ids), len(sample.prompt_ids) + len(sample.output_ids) - 1
        last_generated = torch.tensor([p + span.end - 1 for span in sample.turns or ()], dtype=torch.long)
        turn = torch.bucketize(torch.arange(fed), last_generated, right=True)  # ends at or before j
        turns[i, :fed] = turn.clamp(max=max(len(last_generated) - 1, 0))
    return turns
