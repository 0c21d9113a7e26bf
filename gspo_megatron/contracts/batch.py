"""One RL step's samples as padded tensors, and how they are cut into mini- and micro-batches.

Design decisions:
- Token alignment is "next-token": the model reads ``tokens[:, :-1]`` and scores ``tokens[:, 1:]``;
  every per-token tensor here (masks, log-probs, routed experts) is aligned to those S-1 targets
  (routed experts to the S-1 *inputs*, which is the same index: row t is the token fed at t).
- The driver plans every data-parallel rank's micro-batches from the row lengths (``plan_partition``)
  and sends each rank only the rows its plan names (``loop/distribute.py``): a rank's
  ``RolloutBatch`` holds those rows (``row_ids``, global indices, ascending). Without a budget a
  rank's rows are a contiguous slice of every mini-batch; loss denominators are global counts the
  driver computes from the whole batch.
- Without ``trainer.micro_batch_tokens`` all micro-batches share the padded length S-1 of the whole
  rollout batch; with it each is cut to its own longest row (``token_budget.py``). Micro-batches
  name their rows by global index (``rows``), whichever rows the rank's batch holds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from gspo_megatron.contracts.micro_batch import StepMicroBatch, UpdateMicroBatch
from gspo_megatron.contracts.shared_prefix import build_shared_prefix_layout
from gspo_megatron.contracts.token_budget import token_budget_plan


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
    policy_versions: torch.Tensor | None = None  # long [N]: the engine weight version of each sample
    row_ids: torch.Tensor | None = None  # long [n]: the global rows held, ascending; None: all of them
    # float [N, S-1]: response targets the ENGINE sampled (inserted DTR exit tokens excluded); what the
    # train/rollout log-prob comparisons read. None: every response target was sampled (= response_mask).
    sampled_mask: torch.Tensor | None = None
    # long [N, S-1]: the turn whose engine call fed each input position (multi-turn trajectories, ``rollout/
    # pack.py``); what the routing diagnostics split by. None: single-turn samples
    input_turns: torch.Tensor | None = None

    @property
    def mismatch_mask(self) -> torch.Tensor:
        """Where engine and trainer log-probs are compared: the sampled response targets."""
        return self.response_mask if self.sampled_mask is None else self.sampled_mask

    @property
    def num_sequences(self) -> int:
        """Rows held here (the whole step's count on the driver, a rank's share elsewhere)."""
        return self.tokens.shape[0]

    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """The rows ``rows`` (global indices, ascending) of a whole batch, every per-row field alike."""
        if self.row_ids is not None:
            raise ValueError("select() takes rows of a whole batch; this one already holds a subset")
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = value[rows] if isinstance(value, torch.Tensor) else value
        values["row_ids"] = rows.clone()
        return replace(self, **values)

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions in this batch of the global rows ``rows`` (which it must hold)."""
        if self.row_ids is None:
            return rows
        index = torch.searchsorted(self.row_ids, rows).clamp(max=self.row_ids.numel() - 1)
        if not torch.equal(self.row_ids[index], rows):
            missing = sorted(set(rows.tolist()) - set(self.row_ids.tolist()))
            raise IndexError(f"rows {missing} are not held by this rank's batch")
        return index

    def row_lengths(self) -> torch.Tensor:
        """long [n]: prompt + response tokens of each row held."""
        return self.prompt_lengths + self.response_lengths


# one micro-batch: its rows (global indices) and the width its tokens are cut to
MicroBatchRows = tuple[torch.Tensor, int]


def plan_partition(
    batch: RolloutBatch,
    *,
    updates: int,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    micro_batch_tokens: int | None = None,
    seq_multiple: int = 1,
) -> list[list[MicroBatchRows]]:
    """Rank ``dp_rank``'s micro-batches, per mini-batch, of a whole batch (all N rows of the step).

    Reads only the row lengths and the padded width: the driver plans every rank's share by it, and
    ``partition`` cuts a batch by it.
    """
    lengths, width = batch.row_lengths(), batch.tokens.shape[1]
    num_rows = lengths.numel()
    if num_rows % updates:
        raise ValueError(
            f"{num_rows} sequences cannot be split into {updates} equal mini-batches; make "
            "prompts_per_step * group_size a multiple of trainer.updates_per_rollout"
        )
    per_update = num_rows // updates
    out = []
    for update in range(updates):
        first = update * per_update
        if micro_batch_tokens is not None:
            data_parallel_slice(per_update, dp_size=dp_size, dp_rank=dp_rank)  # the same divisibility check
            plans = token_budget_plan(
                lengths[first : first + per_update],
                first_row=first,
                dp_size=dp_size,
                budget=micro_batch_tokens,
                multiple=seq_multiple,
                max_width=width,
            )
            out.append([(plan.rows[dp_rank], plan.width) for plan in plans])
            continue
        rows = data_parallel_slice(per_update, dp_size=dp_size, dp_rank=dp_rank)
        start = first + rows.start
        out.append(
            [
                (torch.arange(i, min(i + micro_batch_size, first + rows.stop)), width)
                for i in range(start, first + rows.stop, micro_batch_size)
            ]
        )
    return out


def planned_rows(plan: list[list[MicroBatchRows]]) -> torch.Tensor:
    """long [n]: every row a plan names, ascending (the rows its rank must receive)."""
    rows = [r for minibatch in plan for r, _ in minibatch]
    return torch.cat(rows).unique(sorted=True) if rows else torch.zeros(0, dtype=torch.long)


def cut_micro_batches(
    batch: RolloutBatch, plan: list[list[MicroBatchRows]], *, shared_prefix_multiple: int | None = None
) -> list[list[StepMicroBatch]]:
    """The micro-batches of ``plan``, cut from ``batch`` (a whole batch or a rank's rows). ``shared_prefix_multiple``
    (``trainer.shared_prefix``): each micro-batch also carries its packed layout (``contracts/shared_prefix.py``),
    its width a multiple of this; None: off."""
    return [
        [micro_batch(batch, rows, width, shared_prefix_multiple=shared_prefix_multiple) for rows, width in minibatch]
        for minibatch in plan
    ]


def partition(
    batch: RolloutBatch,
    *,
    updates: int,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    micro_batch_tokens: int | None = None,
    seq_multiple: int = 1,
) -> list[list[StepMicroBatch]]:
    """This rank's micro-batches of a whole batch, per mini-batch (one per optimizer update).

    The old-log-prob pass runs over exactly these micro-batches (flattened), so whatever it records
    per micro-batch (log-probs, routing) lines up with the training forwards that replay it. With
    ``micro_batch_tokens`` the rows are packed by length under that budget (``token_budget.py``).
    """
    plan = plan_partition(
        batch,
        updates=updates,
        micro_batch_size=micro_batch_size,
        dp_size=dp_size,
        dp_rank=dp_rank,
        micro_batch_tokens=micro_batch_tokens,
        seq_multiple=seq_multiple,
    )
    return cut_micro_batches(batch, plan)


def data_parallel_slice(num_rows: int, *, dp_size: int, dp_rank: int) -> slice:
    if num_rows % dp_size:
        raise ValueError(
            f"{num_rows} sequences cannot be split evenly over {dp_size} data-parallel ranks; make "
            "prompts_per_step * group_size / updates_per_rollout a multiple of the data-parallel size"
        )
    per_rank = num_rows // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def micro_batch(
    batch: RolloutBatch, rows: torch.Tensor, width: int, *, shared_prefix_multiple: int | None = None
) -> StepMicroBatch:
    """The micro-batch of the rows ``rows`` (global indices) cut to ``width`` tokens: inputs
    ``tokens[:, :width-1]``, ``targets`` one to the right, and the rows of every per-row field; with
    ``shared_prefix_multiple`` its shared-prefix layout too (None where its rows share no prompt)."""
    local = batch.local(rows)

    def cut(value: torch.Tensor) -> torch.Tensor:
        return value[local, : width - 1] if value.dim() > 1 else value[local]

    tokens = batch.tokens[local, :width]
    inputs, response_mask, input_mask = tokens[:, :-1].contiguous(), cut(batch.response_mask), cut(batch.input_mask)
    layout = None
    if shared_prefix_multiple is not None:
        layout = build_shared_prefix_layout(inputs, response_mask, input_mask, multiple=shared_prefix_multiple)
    return StepMicroBatch(
        tokens=inputs,
        targets=tokens[:, 1:].contiguous(),
        rows=rows,
        response_mask=response_mask,
        input_mask=input_mask,
        advantages=cut(batch.advantages),
        rollout_log_probs=cut(batch.rollout_log_probs),
        routed_experts=None if batch.routed_experts is None else cut(batch.routed_experts),
        input_turns=None if batch.input_turns is None else cut(batch.input_turns),
        shared_prefix=layout,
    )


def update_batches(
    minibatches: list[list[StepMicroBatch]],
    batch: RolloutBatch,
    old_log_probs: torch.Tensor,
    reference_log_probs: list[torch.Tensor] | None = None,
) -> list[list[UpdateMicroBatch]]:
    """The updates' micro-batches, built once from what the phases returned: pi_old of this rank's rows
    (``old_log_probs`` [n, S-1], cut to each micro-batch's rows and width) and, on the last pipeline stage
    with a KL reference, the reference's log-probs per micro-batch in ``minibatches``' flattened order."""
    flat_index = 0
    out: list[list[UpdateMicroBatch]] = []
    for minibatch in minibatches:
        built = []
        for mb in minibatch:
            reference = reference_log_probs[flat_index] if reference_log_probs else None
            old = old_log_probs[batch.local(mb.rows), : mb.seq_len]
            built.append(UpdateMicroBatch(**_fields_of(mb), old_log_probs=old, ref_log_probs=reference))
            flat_index += 1
        out.append(built)
    return out


def _fields_of(mb: StepMicroBatch) -> dict:
    """Every field of ``mb`` but the ones an update batch is given (a shallow copy: the same tensors)."""
    given = ("old_log_probs", "ref_log_probs")
    return {f.name: getattr(mb, f.name) for f in fields(mb) if f.name not in given}
