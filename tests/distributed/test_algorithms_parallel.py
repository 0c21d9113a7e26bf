"""The loss head under real gloo collectives: vocab-parallel log-probs (TP = 2, 3) and context-parallel
GSPO/GRPO (CP = 2) equal the single-rank results, values and per-shard gradients."""

import pytest
import torch
import torch.distributed as dist

from gspo_megatron.algorithms import (
    LossConfig,
    LossContext,
    all_reduce_metrics,
    context_parallel_sequence_sum_fn,
    finalize_metrics,
    get_policy_loss,
    merge_metrics,
    vocab_parallel_log_probs,
)
from gspo_megatron.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

VOCAB = 12  # divisible by 2 and 3
TEMPERATURE = 0.7


def _tp_inputs():
    gen = torch.Generator().manual_seed(7)
    logits = 3 * torch.randn(2, 5, VOCAB, generator=gen)
    targets = torch.randint(0, VOCAB, (2, 5), generator=gen)
    targets[1, 4] = -100  # ignore index at padding
    weights = torch.randn(2, 5, generator=gen)
    return logits, targets, weights


def _tp_rank(ctx, chunk_size):
    dist.init_process_group("gloo")
    logits, targets, weights = _tp_inputs()
    shard = VOCAB // ctx.world_size
    local = logits[..., ctx.rank * shard : (ctx.rank + 1) * shard].clone().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(
        local, targets, tp_group=dist.group.WORLD, temperature=TEMPERATURE, chunk_size=chunk_size, with_entropy=True
    )
    (log_probs * weights).sum().backward()
    return log_probs.detach(), entropy, local.grad


@pytest.mark.parametrize("world_size,chunk_size", [(2, None), (3, 3)])
def test_vocab_parallel_log_probs_match_single_rank(world_size, chunk_size):
    logits, targets, weights = _tp_inputs()
    full = logits.clone().requires_grad_()
    ref_log_probs, ref_entropy = vocab_parallel_log_probs(full, targets, temperature=TEMPERATURE, with_entropy=True)
    (ref_log_probs * weights).sum().backward()

    results = run_distributed(_tp_rank, world_size, chunk_size)
    shard = VOCAB // world_size
    for rank, (log_probs, entropy, grad) in enumerate(results):
        torch.testing.assert_close(log_probs, ref_log_probs.detach())
        torch.testing.assert_close(entropy, ref_entropy)
        torch.testing.assert_close(grad, full.grad[..., rank * shard : (rank + 1) * shard])
    assert results[0][0][1, 4] == 0  # the ignore index stays 0 on every rank


CP_CASES = [("gspo", "seq_mean_token_mean"), ("gspo_token", "seq_mean_token_mean")] + [
    ("grpo", a) for a in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum")
]
CP_TOKENS = 6  # each of 2 CP ranks holds 3 tokens of every sequence


def _cp_inputs():
    gen = torch.Generator().manual_seed(11)
    old = -3 * torch.rand(4, CP_TOKENS, generator=gen)
    log_probs = old + 0.2 * torch.randn(4, CP_TOKENS, generator=gen)
    mask = torch.arange(CP_TOKENS) < torch.tensor([6, 4, 2, 1]).unsqueeze(-1)  # seq 2, 3 live on rank 0 only
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.5])
    return log_probs, old, mask, advantages


def _cp_run(log_probs, old, mask, advantages, loss_name, aggregation, sequence_sum):
    leaf = log_probs.clone().requires_grad_()
    settings = LossConfig(name=loss_name, clip_low=0.1, clip_high=0.15, aggregation=aggregation)
    ctx = LossContext(settings, sequence_sum=sequence_sum)
    out = get_policy_loss(loss_name)(leaf, old, advantages, mask, ctx)
    out.loss.backward()
    return out.loss.detach(), leaf.grad, out.metrics


def _cp_rank(ctx):
    dist.init_process_group("gloo")
    log_probs, old, mask, advantages = _cp_inputs()
    half = CP_TOKENS // ctx.world_size
    cols = slice(ctx.rank * half, (ctx.rank + 1) * half)
    sequence_sum = context_parallel_sequence_sum_fn(dist.group.WORLD)
    results = {}
    for loss_name, aggregation in CP_CASES:
        loss, grad, metrics = _cp_run(
            log_probs[:, cols], old[:, cols], mask[:, cols], advantages, loss_name, aggregation, sequence_sum
        )
        # Sums are already whole-sequence (replicated over CP: reduce them over DP only); min/max of
        # token values are local to the CP slice, so reduce those over the CP group.
        extrema = {k: v for k, v in metrics.items() if k.endswith(("/min", "/max"))}
        extrema = all_reduce_metrics(extrema, group=dist.group.WORLD)
        results[(loss_name, aggregation)] = (loss, grad, {**metrics, **extrema})
    return results


def _dp_rank(ctx):
    """Two DP ranks with different micro-batches: all_reduce_metrics equals merging both locally."""
    dist.init_process_group("gloo")
    log_probs, old, mask, advantages = _cp_inputs()
    rows = slice(0, 2) if ctx.rank == 0 else slice(2, 4)
    _, _, metrics = _cp_run(
        log_probs[rows], old[rows], mask[rows], advantages[rows], "grpo", "token_mean", lambda x: x.sum(-1)
    )
    return all_reduce_metrics(metrics, group=dist.group.WORLD)


def test_context_parallel_losses_match_single_rank():
    log_probs, old, mask, advantages = _cp_inputs()
    results = run_distributed(_cp_rank, 2)
    for loss_name, aggregation in CP_CASES:
        ref_loss, ref_grad, ref_metrics = _cp_run(
            log_probs, old, mask, advantages, loss_name, aggregation, lambda x: x.sum(-1)
        )
        assert ref_grad.abs().sum() > 0
        per_rank = [r[(loss_name, aggregation)] for r in results]
        for loss, _, metrics in per_rank:
            torch.testing.assert_close(loss, ref_loss, msg=f"{loss_name}/{aggregation} loss")
            for key, value in ref_metrics.items():
                torch.testing.assert_close(metrics[key], value, msg=f"{loss_name}/{aggregation} {key}")
        grads = torch.cat([grad for _, grad, _ in per_rank], dim=1)  # rank 0 holds tokens 0-2, rank 1 3-5
        torch.testing.assert_close(grads, ref_grad, msg=f"{loss_name}/{aggregation} grad")


def test_all_reduce_metrics_over_data_parallel_ranks_equals_local_merge():
    log_probs, old, mask, advantages = _cp_inputs()
    num_tokens = mask.sum()
    merged = None
    for rows in (slice(0, 2), slice(2, 4)):
        _, _, metrics = _cp_run(
            log_probs[rows], old[rows], mask[rows], advantages[rows], "grpo", "token_mean", lambda x: x.sum(-1)
        )
        merged = merge_metrics(merged, metrics)
    results = run_distributed(_dp_rank, 2)
    for reduced in results:
        assert reduced.keys() == merged.keys()
        for key in merged:
            torch.testing.assert_close(reduced[key], merged[key], msg=key)
    assert finalize_metrics(results[0])["response_length"] == num_tokens / 4
