"""Read a megatron ``dist_checkpointing`` directory, as megatron-core 0.16 to 0.19 write it, without
running code from it.

Megatron's torch_dist loader hands the directory to torch's DCP, which unpickles ``.metadata`` with
plain ``pickle.load`` and every byte item (the layers' ``_extra_state``, and from megatron-core 0.17
the common state) with ``torch.load(weights_only=False)``: a crafted checkpoint executes code in the
trainer on resume. This module is the same load with every unpickling restricted:

- ``.metadata`` is read by ``checkpoint_metadata.py``: an unpickler that admits only the classes
  DCP's metadata is made of and changes no object it did not create, then a check of the whole
  decoded index (types, and every storage path a regular file inside the checkpoint holding the
  bytes it is said to hold). (torch's weights-only unpickler cannot read it: DCP writes pickle
  protocol 4 frames, which that unpickler refuses.)
- byte items are read with ``torch.load(weights_only=True)``: tensors and plain containers only.
- the common (non-sharded) state likewise, wherever the checkpoint keeps it (below).

Anything else is refused with ``UnsafeCheckpointError`` naming the file and what it asked for; a
damaged or foreign file with ``CheckpointFormatError``.

Two formats, told apart by the ``metadata.json`` megatron writes last:
- megatron-core <= 0.16 keeps the common state in ``common.pt`` (``metadata.json`` names a
  ``common_backend``);
- megatron-core >= 0.17 keeps it inside the DCP checkpoint, as the byte object ``common_state``
  (``metadata.json`` names only the sharded backend).
Both are read under every supported megatron-core: ``load_dist_checkpoint`` takes the steps of
megatron's own ``dist_checkpointing.load`` (the same in 0.16 and 0.19) with megatron's own helpers,
and reads the common state and the shards itself. Megatron's ``load`` is not called: in 0.16 it
needs a common-state strategy class that 0.17 removed, and from 0.17 it reads ``.metadata`` through
torch's unrestricted reader before any strategy is asked.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from gspo_megatron.policy.checkpoint.formats import (
    COMMON_STATE_FILE,
    COMMON_STATE_OBJECT,
    CONFIG_FILE,
    METADATA_FILE,
    CheckpointFormatError,
    UnsafeCheckpointError,
    common_state_in_file,
)
from gspo_megatron.policy.checkpoint.metadata import read_metadata_safely


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
    """Megatron's load planner with byte items (``_extra_state``, the common state) read as weights only."""

    def __init__(self, *args: Any, checkpoint_dir: str | Path, **kwargs: Any) -> None:
        # flat state dicts, as megatron >= 0.17 plans them (0.16's flattening found nothing to flatten)
        super().__init__(*args, flatten_state_dict=False, flatten_sharded_tensors=False, **kwargs)
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


def read_common_state(directory: str | Path) -> dict:
    """The checkpoint's common (non-sharded) state, from either format, as plain data only."""
    directory = Path(directory)
    if common_state_in_file(directory):
        path = directory / COMMON_STATE_FILE
        if not path.is_file():
            raise CheckpointFormatError(f"{path}: missing; {directory.parent} is not a complete checkpoint")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"{path}: not plain data; refusing to load it: {str(error).splitlines()[0]}"
            ) from None
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    key = ShardedObject(COMMON_STATE_OBJECT, None, (1,), (0,)).unique_key
    reader = SafeFileSystemReader(directory)
    if key not in reader.read_metadata().state_dict_metadata:
        raise CheckpointFormatError(
            f"{directory / METADATA_FILE} lists no {COMMON_STATE_OBJECT!r} object, and {CONFIG_FILE} names no "
            f"common.pt: {directory} is damaged or was not written by megatron-core"
        )
    state: dict[str, Any] = {key: io.BytesIO()}
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(checkpoint_dir=directory), no_dist=True)
    objects = state[key]  # megatron saves the list of the object's shards' data: one shard
    if not (isinstance(objects, list) and len(objects) == 1 and isinstance(objects[0], dict)):
        raise CheckpointFormatError(f"{directory}: the {COMMON_STATE_OBJECT!r} object is not a state dict")
    return objects[0]


def _load_shards(sharded_state_dict: dict, directory: Path) -> dict:
    """megatron's ``TorchDistLoadShardedStrategy.load`` (0.16 to 0.19) with ``SafeFileSystemReader``
    and ``SafeLoadPlanner``; the private helpers it calls are megatron's own."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
    flexible_shape = [t for t in tensors if not t.allow_shape_mismatch]
    shape_mismatch_allowed = {t.key: t for t in tensors if t.allow_shape_mismatch}
    original = sharded_state_dict
    sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
    pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
    planner = SafeLoadPlanner(
        shapes_validation_sharded_tensors=flexible_shape,
        allow_shape_mismatch_sharded_tensors=shape_mismatch_allowed,
        checkpoint_dir=directory,
    )
    # no_dist: every rank plans and reads its own shards (megatron >= 0.17 does the same)
    dcp.load(pyt_state_dict, storage_reader=SafeFileSystemReader(directory), planner=planner, no_dist=True)
    state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
    state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
    _restore_dict_types(state, original)
    return state


def load_dist_checkpoint(sharded_state_dict: dict, directory: str | Path) -> dict:
    """``dist_checkpointing.load`` of ``directory`` with no unpickling that can run code: megatron's
    steps (common state, preprocessing, access validation, shards, factory merges) in megatron's order,
    for a checkpoint of either format."""
    from megatron.core.dist_checkpointing.dict_utils import merge
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base, force_all_tensors_to_non_fp8
    from megatron.core.dist_checkpointing.validation import (
        StrictHandling,
        determine_global_metadata,
        validate_integrity_and_strict_load,
    )

    directory = Path(directory)
    force_all_tensors_to_non_fp8(sharded_state_dict)
    common_state = read_common_state(directory)
    sharded_state_dict, nonpersistent_state_dict, factories = load_preprocess(sharded_state_dict)
    merge(common_state, nonpersistent_state_dict)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)
    local_metadata, global_metadata = determine_global_metadata(sharded_state_dict)
    sharded_state_dict, _, _ = validate_integrity_and_strict_load(
        sharded_state_dict,
        StrictHandling.ASSUME_OK_UNEXPECTED,  # megatron's default
        True,  # each shard is loaded by exactly one rank as its main replica
        local_metadata,
        global_metadata,
        None,
    )
    merge(common_state, _load_shards(sharded_state_dict, directory))
    return apply_factory_merges(common_state, factories)
