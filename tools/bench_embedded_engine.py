"""Benchmark the embedded rollout engine: decode tokens/s with and without the KV cache, the time
of ``update_weights`` for a full checkpoint-named state dict, and the trainer's whole weight sync
(Megatron ``export_hf_weights`` streamed into ``update_weights``) for the same model on one rank.

    python tools/bench_embedded_engine.py --hidden 64 --layers 2 --experts 4 --batch 8 --new-tokens 64

Design decisions: greedy decoding with no stop rules, so every row produces exactly --new-tokens tokens
and both modes do identical work apart from the cache; the weights come from ``save_pretrained`` of a
same-shaped model (names as on disk, per-expert tensors) and are timed in memory (no disk I/O).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.config import EmbeddedConfig
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--hidden", type=int, default=64)
    add("--layers", type=int, default=2)
    add("--experts", type=int, default=4)
    add("--top-k", type=int, default=2)
    add("--moe-intermediate", type=int, default=32)
    add("--heads", type=int, default=4)
    add("--kv-heads", type=int, default=2)
    add("--vocab", type=int, default=256)
    add("--batch", type=int, default=8, help="rows decoded together (prompts x samples)")
    add("--prompt-len", type=int, default=32)
    add("--new-tokens", type=int, default=64)
    add("--repeats", type=int, default=3, help="best of N timings")
    add("--threads", type=int, default=1)
    add("--device", default="cpu")
    add("--dtype", default="float32")
    return parser.parse_args()


def hf_config(args) -> Qwen3MoeConfig:
    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=args.prompt_len + args.new_tokens + 8,
    )
    config.head_dim = args.hidden // args.heads  # read by the attention; not an __init__ keyword in transformers 5
    return config


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def checkpoint_tensors(args) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as directory:
        Qwen3MoeForCausalLM(hf_config(args)).save_pretrained(directory)
        return load_file(f"{directory}/model.safetensors")


def weight_sync_seconds(args, tensors: dict[str, torch.Tensor], engine: EmbeddedEngine) -> tuple[float, float]:
    """(export only, export -> update_weights) for a one-rank Megatron model of the same shape."""
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.config import MoEModelConfig
    from gspo_megatron.policy.models.conversion import export_hf_weights, load_hf_weights
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    cfg = MoEModelConfig.from_hf_dict(hf_config(args).to_dict())
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout)
    try:
        model = build_model(cfg, layout)
        load_hf_weights(model, cfg, tensors, mesh)

        def export_only():
            for _ in export_hf_weights(model, cfg, mesh):
                pass

        def sync():
            buckets = export_hf_weights(model, cfg, mesh)
            engine.update_weights((item for bucket in buckets for item in bucket), version=3)

        return best_time(export_only, args.repeats), best_time(sync, args.repeats)
    finally:
        mesh.destroy()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    tensors = checkpoint_tensors(args)
    rates = {}
    for use_cache in (True, False):
        engine = EmbeddedEngine(
            hf_config(args),
            EmbeddedConfig(use_cache=use_cache, device=args.device, dtype=args.dtype, max_batch_size=args.batch),
        )
        engine.update_weights(tensors.items(), version=1)
        engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
        seconds = best_time(lambda engine=engine: engine.generate(prompts, params), args.repeats)
        rates[use_cache] = args.batch * args.new_tokens / seconds
        print(
            f"use_cache={use_cache!s:5}  {rates[use_cache]:10.1f} tokens/s  ({seconds:.3f} s for "
            f"{args.batch} x {args.new_tokens} tokens)"
        )
    update_seconds = best_time(lambda: engine.update_weights(tensors.items(), version=2), args.repeats)
    megabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    print(
        f"update_weights: {len(tensors)} tensors, {megabytes:.2f} MiB in {update_seconds * 1e3:.2f} ms "
        f"({megabytes / update_seconds:.0f} MiB/s)"
    )
    export_s, sync_s = weight_sync_seconds(args, tensors, engine)
    print(
        f"megatron export_hf_weights: {export_s * 1e3:.2f} ms; export -> update_weights (the trainer's "
        f"weight sync): {sync_s * 1e3:.2f} ms"
    )
    print(
        f"KV cache speed-up: {rates[True] / rates[False]:.2f}x; update_weights costs "
        f"{update_seconds * rates[True] / args.batch:.2f} cached decode steps; the whole weight sync "
        f"{sync_s * rates[True] / args.batch:.2f}"
    )


if __name__ == "__main__":
    main()
