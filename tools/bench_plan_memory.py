"""Measured vs predicted activation + loss-head memory of one forward-backward (the planner's check).

    python tools/bench_plan_memory.py                    # the tiny preset and a medium shape, one rank

One rank (world 1, fp32, portable spec, CPU). The model and megatron's DDP grad buffers are built
first; the window measured is one call of megatron's forward-backward schedule on one micro-batch
with the project's vocab-parallel log-prob loss, so what it allocates is the activations autograd
keeps, the loss head's logits and gradient, and transients (``testing/memory.py:peak_bytes``: the CPU
allocator's running total of allocations and frees on every thread; on CUDA the allocator's peak).
The prediction is ``tools/planning/activations.py:activation_bytes(...).total()``. Prints both and their
ratio; exits 1 if any ratio leaves [1/1.2, 1.2]. Full recompute cannot be measured on CPU: megatron's checkpoint
function saves the CUDA RNG state (its prediction is the documented formula only).
"""

from __future__ import annotations

import argparse
import sys

import torch

from gspo_megatron.policy.models.config import MoEModelConfig, preset
from gspo_megatron.testing.memory import peak_bytes
from gspo_megatron.testing.model_fixtures import medium_test_config
from planning.activations import MicroBatchShape, activation_bytes

TOLERANCE = 1.2

SHAPES = {
    "tiny": (lambda: preset("tiny"), MicroBatchShape(sequences=8, seq_len=128)),
    "medium": (
        medium_test_config,
        MicroBatchShape(sequences=4, seq_len=256),
    ),
}


def measure(model_cfg: MoEModelConfig, micro: MicroBatchShape) -> int:
    from gspo_megatron.algorithms.logprobs import vocab_parallel_log_probs
    from gspo_megatron.contracts.micro_batch import MicroBatch
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    layout = ParallelLayout(world_size=1).validate(model_cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=3)
    try:
        model = build_model(model_cfg, layout, layer_spec="portable")
        ddp = wrap_for_training(model, model.config)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, model_cfg.vocab_size, (micro.sequences, micro.seq_len + 1), generator=gen)
        batch = [MicroBatch(tokens=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())]

        def loss(logits, mb):
            logp, _ = vocab_parallel_log_probs(logits, mb.targets, tp_group=None)
            value = -logp.sum() / micro.tokens
            return value, {}

        return peak_bytes(lambda: run_schedule([ddp], batch, loss, forward_only=False), "cpu")
    finally:
        mesh.destroy()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args(argv)
    from gspo_megatron.policy.parallel.layout import ParallelLayout

    worst = 1.0
    for name in args.shapes:
        make, micro = SHAPES[name]
        cfg = make()
        predicted = activation_bytes(cfg, ParallelLayout(world_size=1), micro, pp_rank=0).total()
        measured = measure(cfg, micro)
        ratio = predicted / measured
        worst = max(worst, ratio, 1 / ratio)
        print(
            f"{name:7s} tokens={micro.tokens:5d} measured={measured / 2**20:8.2f} MiB "
            f"predicted={predicted / 2**20:8.2f} MiB predicted/measured={ratio:.3f}"
        )
    ok = worst <= TOLERANCE
    print(f"worst factor {worst:.3f} ({'within' if ok else 'OUTSIDE'} the {TOLERANCE:.1f}x tolerance)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
