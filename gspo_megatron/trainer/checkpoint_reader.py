"""Read a megatron ``dist_checkpointing`` directory without running code from it.

Megatron's torch_dist loader hands the directory to torch's DCP, which unpickles ``.metadata`` with
plain ``pickle.load`` and every byte item (the layers' ``_extra_state``) with
``torch.load(weights_only=False)``: a crafted checkpoint executes code in the trainer on resume.
This module is the same load with every unpickling restricted:

- ``.metadata`` is read by an unpickler whose ``find_class`` admits only the classes DCP's own
  metadata is made of (``Metadata``, its storage/chunk/tensor descriptors, ``_StorageInfo``, the
  save-plan records, ``torch.Size``, dtypes, layouts). Those are dataclasses, enums and torch value
  types: constructing them runs no user code. (torch's weights-only unpickler cannot read it: DCP
  writes pickle protocol 4 frames, which that unpickler refuses.)
- byte items are read with ``torch.load(weights_only=True)``: tensors and plain containers only.
- ``common.pt`` likewise with ``weights_only=True`` stated, not left to torch's default.

Anything else is refused with ``UnsafeCheckpointError`` naming the file and the class it asked for.
The loader is megatron's ``TorchDistLoadShardedStrategy.load`` with the reader and the planner
swapped; the private helpers it calls are megatron's own.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

# (module, name) pairs DCP's metadata pickle references; torch dtypes are admitted by type below.
METADATA_CLASSES = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.planner", "SavePlan"),
        ("torch.distributed.checkpoint.planner", "WriteItem"),
        ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ("torch.distributed.checkpoint.planner", "TensorWriteData"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
    }
)


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file asked to construct something other than plain checkpoint data."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, path: str):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._path}: refusing to load: it references {module}.{name}, which is not part of a "
            "checkpoint's metadata (the file may have been crafted to run code; do not load it)"
        )


def read_metadata_safely(path: str | os.PathLike) -> Metadata:
    """DCP metadata from ``path`` through the allow-listed unpickler."""
    with open(path, "rb") as file:
        try:
            metadata = _MetadataUnpickler(file, str(path)).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as error:
            raise UnsafeCheckpointError(f"{path}: not a readable checkpoint metadata file ({error})") from error
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read through the allow-listed unpickler, once (megatron's
    loader asks for it again after loading, as its caching reader allows)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._safe_metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._safe_metadata is None:
            metadata = read_metadata_safely(self._get_metadata_path(kwargs.get("rank")))
            storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            self._safe_metadata = metadata
        return self._safe_metadata


class SafeLoadPlanner(MCoreLoadPlanner):
    """Megatron's load planner with byte items (``_extra_state``) read as weights only."""

    def __init__(self, *args: Any, checkpoint_dir: str | Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checkpoint_dir = Path(checkpoint_dir)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            stored = self.metadata.storage_data[read_item.storage_index].relative_path
            raise UnsafeCheckpointError(
                f"{self._checkpoint_dir / stored}: item {read_item.dest_index.fqn} is not plain data "
                f"(tensors, numbers, strings, containers); refusing to load it: {str(error).splitlines()[0]}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """``TorchDistLoadShardedStrategy.load`` with ``SafeFileSystemReader`` and ``SafeLoadPlanner``."""

    def load(self, sharded_state_dict: dict, checkpoint_dir: Path) -> dict:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        flexible_shape = [t for t in tensors if not t.allow_shape_mismatch]
        shape_mismatch_allowed = {t.key: t for t in tensors if t.allow_shape_mismatch}
        original = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = SafeFileSystemReader(checkpoint_dir)
        planner = SafeLoadPlanner(
            shapes_validation_sharded_tensors=flexible_shape,
            allow_shape_mismatch_sharded_tensors=shape_mismatch_allowed,
            checkpoint_dir=checkpoint_dir,
        )
        dcp.load_state_dict(pyt_state_dict, reader, planner=planner)
        self.cached_global_metadata = reader.read_metadata()
        state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
        _restore_dict_types(state, original)
        return state

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Metadata | None = None) -> dict[str, Any]:
        if metadata is None:
            metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        objects = [
            ShardedObject.empty_from_unique_key(key)
            for key, stored in metadata.state_dict_metadata.items()
            if isinstance(stored, BytesStorageMetadata)
        ]
        return {**{o.unique_key: o for o in objects}, **self.load_tensors_metadata(checkpoint_dir, metadata)}


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """``common.pt`` read with ``weights_only=True`` stated (not left to torch's default)."""

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; {Path(checkpoint_dir).parent} is not a complete checkpoint")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"{path}: not plain data; refusing to load it: {str(error).splitlines()[0]}"
            ) from None


def load_dist_checkpoint(sharded_state_dict: dict, directory: str | Path) -> dict:
    """``dist_checkpointing.load`` of ``directory`` with no unpickling that can run code."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(
        sharded_state_dict,
        str(directory),
        sharded_strategy=SafeTorchDistLoadStrategy(),
        common_strategy=SafeCommonLoadStrategy(),
    )
