"""HF checkpoint export throughput against a raw write of the same bytes with the same durability.

    python tools/bench_hf_export.py                       # ~800 MiB fp32 MoE, 3 interleaved repeats
    python tools/bench_hf_export.py --hidden-size 512 --repeats 5 --profile

One process, one rank: the model is built once from HF-named random weights; then, interleaved,
- ``export``: ``save_hf_checkpoint`` (gather to HF names, shard, write safetensors, fdatasync every
  shard, fsync the directory, rename into place);
- ``raw``: the same shard sizes written from one preallocated buffer with ``os.write`` and
  fdatasync per file plus a directory fsync -- what the disk can do with the export's durability.
Reports the median of each and export / raw (the issue's goal: <= 1.5). ``--profile`` prints the
top functions of one export by cumulative time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def raw_write(directory: Path, sizes: list[int], buffer: memoryview) -> None:
    """One file per shard size, written and fdatasync'ed, then the directory fsync'ed."""
    directory.mkdir(parents=True)
    for i, size in enumerate(sizes):
        fd = os.open(directory / f"raw-{i:05d}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = buffer[:size]
            while view:
                view = view[os.write(fd, view) :]
            os.fdatasync(fd)
        finally:
            os.close(fd)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.config import MoEModelConfig
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.models.hf_checkpoint import save_hf_checkpoint
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.testing.model_fixtures import random_hf_state

    h = args.hidden_size
    cfg = MoEModelConfig(
        vocab_size=4096,
        hidden_size=h,
        num_layers=args.layers,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=h // 8,
        num_experts=args.experts,
        top_k=2,
        moe_intermediate_size=h,
        max_position_embeddings=256,
    )
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=1)
    try:
        model = build_model(cfg, layout, layer_spec="portable")
        load_hf_weights(model, cfg, random_hf_state(cfg, seed=0), mesh)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        shard_bytes = args.shard_mib << 20
        sizes = [min(shard_bytes, total - start) for start in range(0, total, shard_bytes)]
        buffer = memoryview(bytearray(torch.randn(shard_bytes // 4).numpy().tobytes()))
        root = Path(args.dir or tempfile.mkdtemp(prefix="bench_hf_export_"))
        times: dict[str, list[float]] = {"export": [], "raw": []}
        print(f"model: {total / 2**20:.0f} MiB of parameters in {len(sizes)} shards of <= {args.shard_mib} MiB")
        for repeat in range(args.repeats):
            for kind in ("export", "raw") if repeat % 2 == 0 else ("raw", "export"):  # interleaved
                out = root / f"{kind}_{repeat}"
                start = time.perf_counter()
                if kind == "export":
                    save_hf_checkpoint(model, cfg, mesh, out, shard_bytes=shard_bytes)
                else:
                    raw_write(out, sizes, buffer)
                times[kind].append(time.perf_counter() - start)
                shutil.rmtree(out)
        export, raw = statistics.median(times["export"]), statistics.median(times["raw"])
        mb = total / 1e6
        print(f"export: {export:.2f} s ({mb / export:.0f} MB/s)   raw: {raw:.2f} s ({mb / raw:.0f} MB/s)")
        print(f"export / raw = {export / raw:.2f}   (runs: export {times['export']}, raw {times['raw']})")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            save_hf_checkpoint(model, cfg, mesh, root / "profiled", shard_bytes=shard_bytes)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(18)
        shutil.rmtree(root, ignore_errors=True)
    finally:
        mesh.destroy()


if __name__ == "__main__":
    main()
