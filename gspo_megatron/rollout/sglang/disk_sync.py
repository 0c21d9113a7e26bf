"""The disk path of SGLang weight sync: an HF-style checkpoint of the trainer's weights that the servers
load with ``/update_weights_from_disk`` (``engine.py``: every ``v<version>`` directory but the newest is
removed once the servers hold it)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch


def write_safetensors_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]], directory: Path, *, template_dir: str | None, bucket_bytes: int
) -> Path:
    """Write HF-style shards + index into ``directory``, with the template's non-weight files copied.
    Streamed (one shard in memory at a time, no copies); not fdatasync'ed: the servers read it at once."""
    from gspo_megatron.core.safetensors_writer import ShardWriter

    if template_dir is None:
        raise ValueError("weight_sync='disk' needs SGLangConfig.model_path (its config/tokenizer files are copied)")
    directory.mkdir(parents=True, exist_ok=True)
    for source in Path(template_dir).iterdir():
        if source.is_file() and not source.name.endswith((".safetensors", ".bin", ".pt", ".index.json")):
            shutil.copy2(source, directory / source.name)
    writer = ShardWriter(directory, bucket_bytes, durable=False)
    for name, tensor in named_tensors:
        writer.add(name, tensor)
    writer.close()
    return directory


def remove_older_versions(root: Path, keep: str) -> None:
    """Delete ``root/v<N>`` directories other than ``keep`` (only names this engine writes)."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.is_dir() and child.name != keep and re.fullmatch(r"v\d+", child.name):
            shutil.rmtree(child, ignore_errors=True)
