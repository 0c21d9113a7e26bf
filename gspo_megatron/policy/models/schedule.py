"""Run megatron-core's own forward-backward schedule (1F1B with PP, plain without) over micro-batches.

Design decisions:
- Gradients are SUMS of what the loss callback returns, over micro-batches and data-parallel
  (x context-parallel) ranks: ``calculate_per_token_loss=True`` makes megatron's DDP sum instead of
  average and stops the schedule from dividing by the number of micro-batches, and our
  ``finalize_model_grads`` wrapper drops the token count megatron would divide by. The loss
  callbacks therefore return each micro-batch's *contribution* to the global objective, already
  divided by global denominators (see ``algorithms/losses.py``); any layout and any micro-batch
  split then yields the gradient of one big batch.
- The loss callback runs on the last pipeline stage only; it receives the vocab-parallel logits
  [b, s, V/tp] and the ``MicroBatch`` and returns ``(loss, metrics)``; metrics (tensors) come
  back from this function on the last stage, one dict per micro-batch.
- Context parallelism: ``_forward_step`` hands every micro-batch to
  ``parallel/context_parallel.split_micro_batch`` (the one place the sequence is split), so the
  model and the loss callback see this CP rank's share of every per-token tensor.
- Shared prefix (``trainer.shared_prefix``): a micro-batch that carries a packed layout
  (``MicroBatch.shared_prefix``) is fed packed (``policy/models/shared_prefix_forward.py``) and its logits are
  gathered back to the row layout before the loss callback, which sees [b, s, V/tp] as always. Refused under
  context parallelism (the packed rows are not split) and pipeline parallelism (the stages exchange the
  packed activations, whose gather runs only on the last stage).
- Micro-batches of one call may differ in shape (token budgets); then megatron's
  ``variable_seq_lengths`` is on for the call, so pipeline stages exchange shapes.
- Virtual pipeline stages (a list of model chunks, ``policy/models/builder.py:build_model_chunks``): megatron's
  interleaved 1F1B runs every micro-batch through every chunk, each chunk reading its own iterator over
  the same micro-batches; ``before_forward(chunk)`` is told which chunk is about to run. The schedule
  wants at least pp micro-batches, in groups of ``microbatch_group_size_per_vp_stage`` whose last
  remainder is 0 or >= pp; ``microbatch_group_size`` picks pp when it divides the count, else the
  smallest size that leaves a legal remainder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.policy.models.shared_prefix_forward import SharedPrefixError, forward_packed
from gspo_megatron.policy.parallel.context_parallel import chunk_positions, split_micro_batch

# (loss, what comes back for the micro-batch: a metric dict, or a head's typed output); a callback may
# take a MicroBatch subclass (the policy loss reads ``contracts/micro_batch.py:UpdateMicroBatch``), whose
# micro-batches the schedule then carries
BatchT = TypeVar("BatchT", bound=MicroBatch)
LossCallback = Callable[[torch.Tensor, BatchT], tuple[torch.Tensor, Any]]
BeforeForward = Callable[[int], None]  # called with the model chunk about to run a micro-batch's forward


class ScheduleError(ValueError):
    """A call the pipeline schedule cannot run; the message names the fix."""


def wrap_for_training(
    model,
    config,
    *,
    use_distributed_optimizer: bool = False,
    grad_reduce_in_fp32: bool = True,
    bucket_size: int | None = None,
):
    """Wrap in megatron's DistributedDataParallel and install grad finalisation on the config.

    ``use_distributed_optimizer``: the DDP keeps a parameter buffer and reduce-scatters gradients, as
    megatron's distributed optimizer needs; ``policy/optimizer.py`` reads it back from ``ddp_config``.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )

    def finalize_summed_grads(model_chunks, num_tokens=None, pg_collection=None, force_all_reduce=False):
        # Our losses are already normalised by global denominators: never divide by token count.
        return finalize_model_grads(model_chunks, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)

    config.finalize_model_grads_func = finalize_summed_grads
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def microbatch_group_size(num_micro_batches: int, pp: int) -> int:
    """Contiguous micro-batches per virtual stage for megatron's interleaved schedule: in [pp, M], with the
    last group's remainder 0 or >= pp (its ``forward_backward_pipelining_with_interleaving`` checks)."""
    if num_micro_batches < pp:
        raise ScheduleError(
            f"{num_micro_batches} micro-batches cannot fill {pp} pipeline stages under virtual pipeline stages "
            "(interleaved 1F1B needs at least pp micro-batches per call): lower trainer.micro_batch_size, "
            "raise the batch, or set parallel.vpp=1"
        )
    for size in range(pp, num_micro_batches + 1):
        remainder = num_micro_batches % size
        if remainder == 0 or remainder >= pp:
            return size
    return num_micro_batches  # unreachable: size = M leaves remainder 0


def _forward_step(loss_callback: LossCallback | None, before_forward, chunks: list, data_iterator, model):
    from megatron.core import parallel_state as ps

    batch: MicroBatch = next(data_iterator).to(next(model.parameters()).device)
    cp_size, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    if before_forward is not None:
        before_forward(next(i for i, chunk in enumerate(chunks) if chunk is model))
    if batch.shared_prefix is not None:
        if cp_size > 1 or ps.get_pipeline_model_parallel_world_size() > 1 or batch.position_ids is not None:
            raise SharedPrefixError(
                "trainer.shared_prefix=true needs parallel.cp=1, parallel.pp=1 and rows at positions 0..s-1; "
                "set trainer.shared_prefix=false"
            )
        return forward_packed(model, batch.shared_prefix), partial(_loss_func, loss_callback, batch)
    seq_len = batch.seq_len
    batch = split_micro_batch(batch, cp_size, cp_rank)
    tokens = batch.tokens
    positions = batch.position_ids
    if positions is None:  # global positions of this rank's tokens (RoPE splits its own table alike)
        positions = chunk_positions(seq_len, cp_size, cp_rank, device=tokens.device).unsqueeze(0).expand_as(tokens)
    output = model(tokens, positions, attention_mask=None)
    return output, partial(_loss_func, loss_callback, batch)


def _loss_func(loss_callback: LossCallback | None, batch: MicroBatch, output_tensor: torch.Tensor):
    if loss_callback is None:
        return output_tensor.sum() * 0.0, torch.tensor(1, dtype=torch.int), {"logits": output_tensor.detach()}
    loss, metrics = loss_callback(output_tensor, batch)
    return loss, torch.tensor(1, dtype=torch.int), metrics


def run_schedule(
    model,  # one module (a DDP-wrapped stage) or megatron's list of virtual-pipeline chunks
    micro_batches: Sequence[BatchT],
    loss_callback: LossCallback[BatchT] | None,
    *,
    forward_only: bool,
    before_forward: BeforeForward | None = None,
) -> list[Any]:
    """Forward (and backward unless ``forward_only``) every micro-batch through megatron's schedule.

    Returns what the loss callback handed back for each micro-batch on the last pipeline stage (empty list elsewhere).
    Micro-batches may differ in [b, s] (see the module notes). ``before_forward`` runs before each
    micro-batch's forward on each model chunk, in micro-batch order per chunk, with the chunk's index
    (routing replay sets that chunk's targets there).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    if not micro_batches:
        raise ValueError("run_schedule needs at least one micro-batch")
    shapes = {tuple(mb.tokens.shape) for mb in micro_batches}
    batch_size, seq_length = max(shapes, key=lambda shape: shape[0] * shape[1])
    chunks = model if isinstance(model, list) else [model]
    config = get_model_config(chunks[0])
    fixed, group_size = config.variable_seq_lengths, config.microbatch_group_size_per_vp_stage
    # Different shapes in one call (token-budget micro-batches): pipeline stages exchange each
    # tensor's shape first. Set here rather than at build time because megatron refuses the flag with
    # the allgather dispatcher in general; the token-budget plan gives micro-batch j one shape on
    # every rank (contracts/token_budget.py), which is all that dispatcher's all-gathers need.
    config.variable_seq_lengths = fixed or len(shapes) > 1
    data_iterator: Any = iter(micro_batches)
    if len(chunks) > 1:  # interleaved 1F1B: every chunk reads every micro-batch, in order
        config.microbatch_group_size_per_vp_stage = microbatch_group_size(
            len(micro_batches), config.pipeline_model_parallel_size
        )
        data_iterator = [iter(micro_batches) for _ in chunks]
    try:
        results = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_callback, before_forward, chunks),
            data_iterator=data_iterator,
            model=chunks,
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=batch_size,
            forward_only=forward_only,
        )
    finally:
        config.variable_seq_lengths, config.microbatch_group_size_per_vp_stage = fixed, group_size
    return list(results or [])
