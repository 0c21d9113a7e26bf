r"""Offline conversion between a HF checkpoint directory and a megatron distributed checkpoint.

    python -m gspo_megatron.launcher --nproc-per-node 2 --script tools/convert_checkpoint.py \
        hf-to-mcore --hf-dir HF --out MCORE --tp 2
    python -m gspo_megatron.launcher --nproc-per-node 2 --script tools/convert_checkpoint.py \
        mcore-to-hf --mcore-dir MCORE --out HF2 --ep 2
    python tools/convert_checkpoint.py mcore-to-hf --mcore-dir runs/x/checkpoints/step_000200 --out HF3
    python tools/convert_checkpoint.py mcore-to-hf --mcore-dir runs/x/checkpoints/step_000200 --out HF3_FP8 --fp8-block

(the project's launcher: one rendezvous store, on loopback; torchrun works too, on a single machine
its stores listen on every interface).

Design decisions:
- The megatron side is ``dist_checkpointing`` of ``{"model": GPTModel.sharded_state_dict()}``, the
  same structure as the trainer's ``checkpoints/step_N/model_optim`` (without the optimizer), so a
  checkpoint written under one layout loads under any other, and a trainer checkpoint converts
  directly. ``hf-to-mcore`` also writes the HF ``config.json`` beside it, so the reverse direction
  knows the model shape; for a trainer checkpoint the shape comes from its saved run config.
- Weights go through the same code as training: ``load_hf_weights`` (each rank reads only its
  shards) and ``save_hf_checkpoint`` (streamed, driver writes). ``--tp/--pp/--ep/--etp`` choose the
  layout the conversion runs under; its product (x data parallel) must be the world size.
- ``__main__`` guard: dist_checkpointing starts worker processes with spawn, which re-imports this.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
TRAINER_MODEL_DIR = "model_optim"
TRAINER_STATE = "trainer_state.pt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF directory -> megatron distributed checkpoint")
    to_mcore.add_argument("--hf-dir", required=True, help="directory with config.json and safetensors")
    to_hf = sub.add_parser("mcore-to-hf", help="megatron distributed checkpoint -> HF directory")
    to_hf.add_argument(
        "--mcore-dir",
        required=True,
        help="a directory written by hf-to-mcore, or a trainer checkpoint (checkpoints/step_N)",
    )
    to_hf.add_argument(
        "--hf-config",
        default=None,
        help="config.json (or its directory) giving the shape; default: found next to the checkpoint",
    )
    to_hf.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from here into the export")
    to_hf.add_argument("--shard-bytes", type=int, default=2 << 30)
    to_hf.add_argument(
        "--fp8-block",
        action="store_true",
        help="write the projections as block FP8 (e4m3, 128x128 scales): a checkpoint SGLang serves in FP8, for "
        "rollout.sglang.weight_quantization=fp8_block",
    )
    for p in (to_mcore, to_hf):
        p.add_argument("--out", required=True, help="output directory (must not exist for hf-to-mcore)")
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--ep", type=int, default=1)
        p.add_argument("--etp", type=int, default=None)
        p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype")
        p.add_argument("--layer-spec", choices=["auto", "te", "portable"], default="auto")
    return parser.parse_args(argv)


def _setup(args, cfg):
    import torch

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, world_size=world).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout)
    dtype = getattr(torch, DTYPES[args.dtype])
    model = build_model(cfg, layout, params_dtype=dtype, layer_spec=args.layer_spec)
    return mesh, model


def hf_to_mcore(args) -> Path:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from gspo_megatron.policy.models.config import MoEModelConfig
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.models.weight_sources import SafetensorsSource

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} exists and is not empty; choose a new directory")
    cfg = MoEModelConfig.from_hf_config_file(args.hf_dir)
    mesh, model = _setup(args, cfg)
    load_hf_weights(model, cfg, SafetensorsSource(args.hf_dir), mesh)
    if mesh.is_driver:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(out))
    if mesh.is_driver:  # after the save: dist_checkpointing wants an empty directory
        (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    dist.barrier()
    mesh.destroy()
    return out


def resolve_mcore_checkpoint(mcore_dir: str | Path, hf_config: str | None):
    """(dist_checkpointing directory, MoEModelConfig) for a converted or a trainer checkpoint."""
    from gspo_megatron.policy.models.config import MoEModelConfig

    directory = Path(mcore_dir)
    if (directory / TRAINER_MODEL_DIR).is_dir():  # the trainer's checkpoints/step_N
        weights = directory / TRAINER_MODEL_DIR
        if hf_config is not None:
            return weights, MoEModelConfig.from_hf_config_file(hf_config)
        return weights, _trainer_model_config(directory / TRAINER_STATE)
    if not (directory / "metadata.json").is_file():
        raise SystemExit(f"--mcore-dir {directory} is neither a dist_checkpointing directory nor a trainer checkpoint")
    config = Path(hf_config) if hf_config is not None else directory / "config.json"
    if not config.exists():
        raise SystemExit(f"no model config: {config} is missing; pass --hf-config CONFIG_JSON")
    return directory, MoEModelConfig.from_hf_config_file(config)


def _trainer_model_config(state_file: Path):
    import torch
    from omegaconf import OmegaConf

    from gspo_megatron.policy.models.config import MoEModelConfig

    if not state_file.is_file():
        raise SystemExit(f"{state_file} is missing: not a complete trainer checkpoint (pass --hf-config)")
    state = torch.load(state_file, weights_only=True)  # plain data: a checkpoint cannot run code
    model = OmegaConf.to_container(OmegaConf.create(state["config"]).model, resolve=True)
    if not isinstance(model, dict):
        raise SystemExit(f"{state_file}: the saved config's model section is not a mapping (pass --hf-config)")
    return MoEModelConfig(**{k: model[k] for k in MoEModelConfig.field_names() if k in model})


def mcore_to_hf(args) -> Path:
    from gspo_megatron.policy.checkpoint.reader import load_dist_checkpoint
    from gspo_megatron.policy.models.hf_checkpoint import save_hf_checkpoint

    weights, cfg = resolve_mcore_checkpoint(args.mcore_dir, args.hf_config)
    mesh, model = _setup(args, cfg)
    loaded = load_dist_checkpoint({"model": model.sharded_state_dict()}, weights)  # runs no code from the files
    model.load_state_dict(loaded["model"])
    out = save_hf_checkpoint(
        model,
        cfg,
        mesh,
        args.out,
        shard_bytes=args.shard_bytes,
        tokenizer_dir=args.tokenizer_dir,
        fp8_block=args.fp8_block,
    )
    mesh.destroy()
    return out


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.getLogger("megatron").setLevel(logging.WARNING)
    args = parse_args(argv)
    out = hf_to_mcore(args) if args.direction == "hf-to-mcore" else mcore_to_hf(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[convert] {args.direction}: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gspo_megatron.core.known_warnings import filter_known_warnings

    filter_known_warnings()  # the trainer's reviewed third-party warnings, hidden here as there
    sys.exit(main())
