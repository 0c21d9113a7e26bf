"""Update-phase time with and without token-budget micro-batches, on long-tailed response lengths.

    python tools/bench_token_budget.py                       # 64 rows, responses 8..80 tokens, 3 rounds
    python tools/bench_token_budget.py --rows 128 --max-response 160 --budget 1024 --rounds 5

One rank builds the MoE model (``tiny_test_config`` widened by the flags) and a ``RolloutBatch``
whose response lengths follow a long tail (most short, a few up to ``--max-response``: 10x spread by
default); then it times the policy update -- megatron's forward+backward with the trainer's
``PolicyLossHead`` over ``partition``'s micro-batches -- padded to the longest row
(``micro_batch_size``) and under ``--budget`` tokens per micro-batch, interleaved round by round,
and prints the padded-token fraction, the mean update seconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time


def long_tailed_lengths(rows: int, low: int, high: int, seed: int) -> list[int]:
    """Pareto-like lengths in [low, high]: P(length > x) ~ (low / x)^1.2."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, generator=generator)
    return [min(high, int(low / float(x) ** (1 / 1.2))) for x in u.clamp_min(1e-6)]


def bench_worker(ctx, args) -> dict:
    import torch

    from gspo_megatron.algorithms.config import AlgorithmConfig
    from gspo_megatron.contracts.batch import partition, update_batches
    from gspo_megatron.contracts.samples import FinishReason, Sample
    from gspo_megatron.contracts.token_budget import step_padded_fraction
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.loss_heads import PolicyLossHead
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.rollout.pack import pack_samples
    from gspo_megatron.testing.model_fixtures import tiny_test_config

    cfg = tiny_test_config(
        hidden_size=args.hidden,
        num_layers=args.layers,
        vocab_size=256,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=args.hidden,
        head_dim=16,
        max_position_embeddings=args.prompt + args.max_response + 8,
    )
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=3)
    model = build_model(cfg, layout)
    ddp = wrap_for_training(model, model.config)
    generator = torch.Generator().manual_seed(1)
    lengths = long_tailed_lengths(args.rows, args.min_response, args.max_response, seed=2)
    samples = [
        Sample(
            prompt_ids=torch.randint(1, 256, (args.prompt,), generator=generator).tolist(),
            output_ids=torch.randint(1, 256, (n,), generator=generator).tolist(),
            output_log_probs=-torch.rand(n, generator=generator),
            finish_reason=FinishReason.STOP,
        )
        for n in lengths
    ]
    n = len(samples)
    batch = pack_samples(samples, torch.randn(n, generator=generator), torch.rand(n), torch.rand(n), pad_token_id=0)
    mask = batch.response_mask
    head = PolicyLossHead(
        AlgorithmConfig(),
        mesh.tp_group,
        None,
        1.0,
        global_num_sequences=(mask.sum(1) > 0).sum().float(),
        global_num_tokens=mask.sum(),
    )
    variants = {"padded": None, "budget": args.budget}
    parts = {  # pi_old = the engine's log-probs (as trainer.old_log_probs=rollout)
        name: update_batches(
            partition(
                batch,
                updates=1,
                micro_batch_size=args.micro_batch_size,
                dp_size=1,
                dp_rank=0,
                micro_batch_tokens=budget,
            ),
            batch,
            batch.rollout_log_probs,
        )
        for name, budget in variants.items()
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, part in parts.items():
            ddp.zero_grad_buffer()
            start = time.perf_counter()
            run_schedule([ddp], part[0], head, forward_only=False)
            if round_:
                seconds[name].append(time.perf_counter() - start)
    mesh.destroy()
    return {
        "lengths": lengths,
        "padded_frac": {
            name: step_padded_fraction(float(batch.input_mask.sum()), part, 1) for name, part in parts.items()
        },
        "micro_batches": {name: len(part[0]) for name, part in parts.items()},
        "seconds": seconds,
    }


def main(argv=None) -> None:
    from gspo_megatron.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--min-response", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=80)
    parser.add_argument("--micro-batch-size", type=int, default=16, help="rows per micro-batch when padded")
    parser.add_argument("--budget", type=int, default=16 * 40, help="trainer.micro_batch_tokens")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    (result,) = run_distributed(bench_worker, 1, args, timeout=3600)
    lengths = sorted(result["lengths"])
    print(
        f"{args.rows} rows, prompt {args.prompt}, responses {lengths[0]}..{lengths[-1]} tokens "
        f"(median {lengths[len(lengths) // 2]}), hidden {args.hidden}, {args.layers} layers"
    )
    mean = {name: statistics.fmean(s) for name, s in result["seconds"].items()}
    for name in ("padded", "budget"):
        label = "padded to longest row" if name == "padded" else f"token budget {args.budget}"
        print(
            f"{label:<24} micro-batches {result['micro_batches'][name]:>3}  padded-token fraction "
            f"{result['padded_frac'][name]:.3f}  update {mean[name]:.3f} s (rounds: "
            f"{', '.join(f'{s:.3f}' for s in result['seconds'][name])})"
        )
    ratio = mean["padded"] / mean["budget"]
    print(f"update time padded / budget: {ratio:.2f}x (interleaved, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
