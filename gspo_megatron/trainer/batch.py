"""One RL step's samples as padded tensors, and how they are cut into mini- and micro-batches.

Design decisions:
- Token alignment is "next-token": the model reads ``tokens[:, :-1]`` and scores ``tokens[:, 1:]``;
  every per-token tensor here (masks, log-probs, routed experts) is aligned to those S-1 targets
  (routed experts to the S-1 *inputs*, which is the same index: row t is the token fed at t).
- The batch is identical on every rank (the driver broadcasts it); each data-parallel rank takes a
  contiguous slice of every mini-batch, so denominators are simple global counts.
- Without ``trainer.micro_batch_tokens`` all micro-batches share the padded length S-1 of the whole
  rollout batch; with it each is cut to its own longest row (``micro_batches.py``). Micro-batches
  name their rows by global index (``rows``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from gspo_megatron.models.micro_batch import MicroBatch
from gspo_megatron.rollout.types import Sample
from gspo_megatron.trainer.micro_batches import token_budget_plan


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # long [N, S] prompt + response, right-padded
    response_mask: torch.Tensor  # float [N, S-1]: 1 where the target token is a response token
    input_mask: torch.Tensor  # float [N, S-1]: 1 where the input token is real (not padding)
    rollout_log_probs: torch.Tensor  # float [N, S-1]: engine log-probs at response targets, else 0
    advantages: torch.Tensor  # float [N]
    rewards: torch.Tensor  # float [N] verifier rewards
    shaped_rewards: torch.Tensor  # float [N] after reward shaping
    prompt_lengths: torch.Tensor  # long [N]
    response_lengths: torch.Tensor  # long [N]
    routed_experts: torch.Tensor | None = None  # int [N, S-1, layers, k] from the engine (R3)
    old_log_probs: torch.Tensor | None = None  # float [N, S-1], filled by the trainer
    policy_versions: torch.Tensor | None = None  # long [N]: the engine weight version of each sample

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: slice) -> RolloutBatch:
        """The sub-batch of rows ``index`` (a slice), every tensor field sliced alike."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = value[index] if isinstance(value, torch.Tensor) else value
        return replace(self, **values)


def pack_samples(
    samples: list[Sample],
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    shaped_rewards: torch.Tensor,
    pad_token_id: int,
    with_routed_experts: bool = False,
) -> RolloutBatch:
    """Right-pad prompt+response token ids into one batch, with masks aligned to the targets."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    lengths = [len(s.prompt_ids) + len(s.output_ids) for s in samples]
    width = max(lengths)
    n = len(samples)
    tokens = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(n, width - 1)
    input_mask = torch.zeros(n, width - 1)
    rollout_logp = torch.zeros(n, width - 1)
    routed = None
    for i, sample in enumerate(samples):
        p, r = len(sample.prompt_ids), len(sample.output_ids)
        tokens[i, :p] = torch.tensor(sample.prompt_ids, dtype=torch.long)
        tokens[i, p : p + r] = torch.tensor(sample.output_ids, dtype=torch.long)
        # target index j scores token j+1: response tokens p..p+r-1 are targets p-1..p+r-2
        mask[i, p - 1 : p + r - 1] = 1.0
        input_mask[i, : p + r - 1] = 1.0  # the last token is never fed (SGLang's routed rows alike)
        if "forced_mask" in sample.extra:
            # tokens the truncated rollout inserted (closing the thinking block) were not sampled by
            # the policy: they are context, not actions -- no loss, no log-prob comparison
            mask[i, p - 1 : p + r - 1] *= 1.0 - sample.extra["forced_mask"].float()
        rollout_logp[i, p - 1 : p + r - 1] = sample.output_log_probs.float()
        if with_routed_experts:
            if sample.routed_experts is None:
                raise ValueError(
                    "rollout routing replay needs routed experts from the engine, but a sample has none; "
                    "the engine must be asked with return_routed_experts"
                )
            if routed is None:
                layers, k = sample.routed_experts.shape[1:]
                routed = torch.zeros(n, width - 1, layers, k, dtype=torch.int32)
            routed[i, : p + r - 1] = sample.routed_experts.to(torch.int32)
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        input_mask=input_mask,
        rollout_log_probs=rollout_logp,
        advantages=advantages.float(),
        rewards=rewards.float(),
        shaped_rewards=shaped_rewards.float(),
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples]),
        response_lengths=torch.tensor([len(s.output_ids) for s in samples]),
        routed_experts=routed,
        policy_versions=torch.tensor([s.weight_version for s in samples], dtype=torch.long),
    )


def partition(
    batch: RolloutBatch,
    updates: int,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    micro_batch_tokens: int | None = None,
    seq_multiple: int = 1,
) -> list[list[MicroBatch]]:
    """This rank's micro-batches, per mini-batch (one mini-batch per optimizer update).

    The old-log-prob pass runs over exactly these micro-batches (flattened), so whatever it records
    per micro-batch (log-probs, routing) lines up with the training forwards that replay it. With
    ``micro_batch_tokens`` the rows are packed by length under that budget (``micro_batches.py``).
    """
    if batch.num_sequences % updates:
        raise ValueError(
            f"{batch.num_sequences} sequences cannot be split into {updates} equal mini-batches; make "
            "prompts_per_step * group_size a multiple of trainer.updates_per_rollout"
        )
    per_update = batch.num_sequences // updates
    out = []
    for update in range(updates):
        first = update * per_update
        if micro_batch_tokens is not None:
            data_parallel_slice(per_update, dp_size, dp_rank)  # the same divisibility check
            lengths = (batch.prompt_lengths + batch.response_lengths)[first : first + per_update]
            plans = token_budget_plan(
                lengths, first, dp_size, micro_batch_tokens, multiple=seq_multiple, max_width=batch.tokens.shape[1]
            )
            out.append([micro_batch(batch, plan.rows[dp_rank], plan.width) for plan in plans])
            continue
        rows = data_parallel_slice(per_update, dp_size, dp_rank)
        start = first + rows.start
        out.append(
            [
                micro_batch(batch, torch.arange(i, min(i + micro_batch_size, first + rows.stop)), batch.tokens.shape[1])
                for i in range(start, first + rows.stop, micro_batch_size)
            ]
        )
    return out


def data_parallel_slice(num_rows: int, dp_size: int, dp_rank: int) -> slice:
    if num_rows % dp_size:
        raise ValueError(
            f"{num_rows} sequences cannot be split evenly over {dp_size} data-parallel ranks; make "
            "prompts_per_step * group_size / updates_per_rollout a multiple of the data-parallel size"
        )
    per_rank = num_rows // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def micro_batch(batch: RolloutBatch, rows: torch.Tensor, width: int) -> MicroBatch:
    """The micro-batch of the batch rows ``rows`` (global indices) cut to ``width`` tokens: inputs
    ``tokens[:, :width-1]``, ``targets`` one to the right, and the rows of every per-row field."""

    def cut(value: torch.Tensor | None) -> torch.Tensor | None:
        if value is None:
            return None
        return value[rows, : width - 1] if value.dim() > 1 else value[rows]

    tokens = batch.tokens[rows, :width]
    return MicroBatch(
        tokens=tokens[:, :-1].contiguous(),
        targets=tokens[:, 1:].contiguous(),
        rows=rows,
        response_mask=cut(batch.response_mask),
        input_mask=cut(batch.input_mask),
        advantages=cut(batch.advantages),
        old_log_probs=cut(batch.old_log_probs),
        rollout_log_probs=cut(batch.rollout_log_probs),
        routed_experts=cut(batch.routed_experts),
    )
