"""Hugging Face checkpoint directories in and out: sharded safetensors + index + config + tokenizer.

``save_hf_checkpoint`` writes what ``transformers`` and SGLang load (``from_pretrained`` /
``--model-path``) from a model on any parallel layout; ``hf_shape_fields`` reads a checkpoint's
``config.json`` into ``MoEModelConfig`` fields so a run takes its shape from the weights it loads.

Design decisions:
- Collective, driver writes: every rank iterates ``export_hf_weights`` (the gathers are collective);
  only the driver (global rank 0) writes. Each bucket is moved into the current shard and released,
  so the driver holds at most one shard plus one export unit (a layer) -- never the whole model.
- Shards close *before* they would exceed ``shard_bytes``; a single tensor larger than that gets a
  shard of its own (as ``save_pretrained`` does). Files are named ``model-0000i-of-0000N`` once N is
  known, and ``model.safetensors.index.json`` is always written (transformers and SGLang accept an
  index with one shard).
- Atomic: everything goes into ``<out>.partial`` (same parent, same filesystem), then replaces
  ``<out>`` by rename. A crash leaves either the previous export or none at ``<out>``, never a mix;
  a stale ``.partial`` is removed by the next save.
- Disk speed, durably: each tensor's bytes go from its own memory to the shard file
  (``safetensors_writer.py``; no clone, no in-memory copy of the shard), every shard is fdatasync'ed,
  and the parent directory is fsync'ed after the rename. Export pieces may be views of live
  parameters or share storage (gate/up halves of one fused weight): they are written before the
  export continues, so holding them until their shard is written is safe.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gspo_megatron.core.fp8_blocks import FP8_DTYPE, QUANTIZATION_CONFIG, SCALE_SUFFIX, quantize_named_tensors
from gspo_megatron.core.safetensors_writer import ShardWriter, fsync_path, write_durably
from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.models.conversion import export_hf_weights

CONFIG_FILE = "config.json"
# Files a tokenizer directory may hold (tokenizers, sentencepiece, BPE, chat template).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
DEFAULT_SHARD_BYTES = 2 << 30


class HFCheckpointError(ValueError):
    """An export or import request that cannot be met; the message names the path and the fix."""


def hf_config_dict(cfg: MoEModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the export: the model's HF config with the dtype actually written."""
    out = cfg.to_hf_dict()
    name = str(dtype).removeprefix("torch.")
    out["torch_dtype"] = name
    out["dtype"] = name  # the key transformers >= 5 writes
    return out


def write_hf_checkpoint(
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    cfg: MoEModelConfig,
    out_dir: str | Path,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer_dir: str | Path | None = None,
    fp8_block: bool = False,
) -> Path:
    """Driver side of ``save_hf_checkpoint``: write HF-named buckets as a checkpoint directory. ``fp8_block``:
    the projections as block FP8 with their scales and ``quantization_config`` in ``config.json``
    (``core/fp8_blocks.py``: what SGLang serves as an FP8 model)."""
    out = Path(out_dir)
    tokenizer_files = _tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []
    config = cfg.to_hf_dict()  # refuses models HF cannot represent before anything is written
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        writer = ShardWriter(partial, shard_bytes)
        dtype = None
        for bucket in buckets:
            for name, tensor in quantize_named_tensors(bucket) if fp8_block else bucket:
                writer.add(name, tensor)
                if dtype is None and tensor.dtype != FP8_DTYPE and not name.endswith(SCALE_SUFFIX):
                    dtype = tensor.dtype  # the unquantized tensors' dtype
        writer.close()
        if dtype is None:
            raise ValueError(f"no tensors to write into the HF checkpoint {out_dir}")
        config = hf_config_dict(cfg, dtype)
        if fp8_block:
            config["quantization_config"] = dict(QUANTIZATION_CONFIG)
        write_durably(partial / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
        for file in tokenizer_files:
            shutil.copy2(file, partial / file.name)
            fsync_path(partial / file.name)
        fsync_path(partial)
        _replace_directory(partial, out)
        fsync_path(out.parent)  # the rename itself survives a crash
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def save_hf_checkpoint(
    model,
    cfg: MoEModelConfig,
    mesh,
    out_dir: str | Path,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    tokenizer_dir: str | Path | None = None,
    bucket_bytes: int = 64 << 20,
    fp8_block: bool = False,
) -> Path:
    """Write this (possibly sharded) model as a HF checkpoint at ``out_dir``; collective on all ranks.
    ``model``: one model chunk or a rank's list of chunks (``policy/models/conversion.py:model_chunks``).

    ``mesh=None`` means a single process without torch.distributed. ``dtype`` casts the written
    tensors (default: the parameters' dtype). Returns ``out_dir`` on every rank once it is complete.
    """
    import torch.distributed as dist

    distributed = mesh is not None and dist.is_initialized()
    is_driver = not distributed or dist.get_rank() == 0
    buckets = export_hf_weights(model, cfg, mesh, bucket_bytes=min(bucket_bytes, shard_bytes), dtype=dtype)
    error: BaseException | None = None
    if is_driver:
        try:
            write_hf_checkpoint(
                buckets, cfg, out_dir, shard_bytes=shard_bytes, tokenizer_dir=tokenizer_dir, fp8_block=fp8_block
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised once the other ranks are released
            error = exc
    for _ in buckets:  # other ranks: the export's collectives; a failed driver: finish them too
        pass
    if distributed:
        status = [repr(error) if error is not None else None]
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None and error is None:
            raise HFCheckpointError(f"the driver failed to write {out_dir}: {status[0]}")
    if error is not None:
        raise error
    return Path(out_dir)


def _tokenizer_files(tokenizer_dir: str | Path) -> list[Path]:
    directory = Path(tokenizer_dir)
    if not directory.is_dir():
        raise HFCheckpointError(f"tokenizer_dir {directory} is not a directory")
    files = [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not any(f.name != "generation_config.json" for f in files):
        raise HFCheckpointError(
            f"tokenizer_dir {directory} holds none of {list(TOKENIZER_FILES[:8])}; pass the directory "
            "that tokenizer.save_pretrained wrote, or no tokenizer_dir"
        )
    return files


def _replace_directory(new: Path, target: Path) -> None:
    """Put ``new`` at ``target``; an existing ``target`` is removed only after the rename."""
    if not target.exists():
        os.replace(new, target)
        return
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old)


# --------------------------------------------------------------------------------------------
# Import side: the model shape comes from the checkpoint
# --------------------------------------------------------------------------------------------
def hf_shape_fields(checkpoint_dir: str | Path) -> dict[str, Any]:
    """``MoEModelConfig`` fields read from a HF checkpoint's ``config.json`` (validated)."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise HFCheckpointError(f"model.hf_checkpoint={directory} is not a directory")
    return MoEModelConfig.from_hf_config_file(directory).to_dict()
