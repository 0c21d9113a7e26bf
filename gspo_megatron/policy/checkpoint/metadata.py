"""DCP's ``.metadata`` read without trusting anything in it: no code runs, no object outside the file
changes, and nothing the file names is opened or allocated before it has been checked.

torch's DCP unpickles ``.metadata`` with plain ``pickle.load``: a crafted file runs code, and even an
unpickler that only admits the metadata's own classes (``find_class``) lets a BUILD opcode set
attributes on those classes -- or on ``torch.serialization._get_layout`` -- for the whole process.
Design decisions:
- The file is read whole into memory first (at most ``MAX_METADATA_BYTES``), so a frame or byte
  string claiming a TiB can only come up short against the bytes that exist: no read allocates more
  than the file holds.
- Python's own unpickler (``pickle._Unpickler``) with three opcode handlers replaced: BUILD only on
  an instance this load created with NEWOBJ, of an admitted dataclass, once, with a state naming
  that class's fields (or, for ``TensorProperties``, the tuple its own ``__setstate__`` reads);
  APPEND(S)/SETITEM(S)/ADDITEMS only on a list/dict/set this load made; INST/OBJ (protocol 0/1
  construction) never. ``find_class`` admits only the classes DCP's metadata is made of.
- The decoded ``Metadata`` is then checked as a whole, by exact type, field by field. Every storage
  path must be a plain file name in the checkpoint's directory naming a regular file (no directory,
  link, FIFO or device), and every item's offset + length must lie inside that file; so a truncated
  shard is named here, before a byte of it is read. Megatron's ``all_local_plans`` (save plans it
  attaches for reuse at the next save) is checked to be a list of save plans and dropped: loading
  never reads it.
- Every failure is one of two errors naming the file: ``UnsafeCheckpointError`` (it asked for
  something a checkpoint never holds) or ``CheckpointFormatError`` (damaged, truncated, foreign).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from gspo_megatron.policy.checkpoint.formats import CheckpointFormatError, UnsafeCheckpointError

MAX_METADATA_BYTES = 1 << 30  # a 235B model's index is tens of MB
MAX_DIMS = 64
_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")

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
_EXTRA_ATTRIBUTES = {"Metadata": frozenset({"all_local_plans"})}  # megatron's, beside DCP's fields
_BUILD = pickle.BUILD[0]
_MUTATIONS = {
    pickle.APPEND[0]: list,
    pickle.APPENDS[0]: list,
    pickle.SETITEM[0]: dict,
    pickle.SETITEMS[0]: dict,
    pickle.ADDITEMS[0]: set,
}


# Python's own unpickler (the C one's opcode handlers cannot be replaced); private to the pickle
# module, unchanged in meaning since Python 3.0, and untyped in typeshed.
_PythonUnpickler: Any = pickle._Unpickler


class _StrictUnpickler(_PythonUnpickler):
    dispatch = dict(_PythonUnpickler.dispatch)

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path
        self._created: dict[int, Any] = {}  # id -> object: what NEWOBJ made in this load (kept alive)
        self._built: set[int] = set()
        self._containers: dict[int, Any] = {}  # lists, dicts and sets this load made

    def _refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self._path}: refusing to load: {what} (a checkpoint's metadata never does; the file may have been "
            "crafted to change this process: do not load it)"
        )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise self._refuse(f"it references {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse("it asks for a persistent object")

    def _new_container(self, container: Any) -> None:
        self._containers[id(container)] = container
        self.append(container)

    def load_empty_list(self) -> None:
        self._new_container([])

    def load_empty_dictionary(self) -> None:
        self._new_container({})

    def load_empty_set(self) -> None:
        self._new_container(set())

    def load_list(self) -> None:
        self._new_container(self.pop_mark())

    def load_dict(self) -> None:
        items = self.pop_mark()
        self._new_container({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)})

    def load_newobj(self) -> None:
        super().load_newobj()
        made = self.stack[-1]
        self._created[id(made)] = made

    def load_newobj_ex(self) -> None:
        super().load_newobj_ex()
        made = self.stack[-1]
        self._created[id(made)] = made

    def load_build(self) -> None:
        state, target = self.stack[-1], self.stack[-2]
        cls = type(target)
        if id(target) not in self._created or not dataclasses.is_dataclass(cls) or isinstance(target, type):
            raise self._refuse(f"it sets attributes of an existing {cls.__module__}.{cls.__qualname__}")
        if id(target) in self._built:
            raise self._refuse(f"it sets the attributes of one {cls.__qualname__} twice")
        if "__setstate__" in vars(cls):  # TensorProperties: its own __setstate__ reads a tuple of values
            if type(state) is not tuple:
                raise self._refuse(f"it gives {cls.__qualname__} a {type(state).__name__} state")
        else:
            fields = _field_names(cls) | _EXTRA_ATTRIBUTES.get(cls.__name__, frozenset())
            parts = state if type(state) is tuple and len(state) == 2 else (state,)  # (dict, slot dict)
            for part in parts:
                unknown = set(part) - fields if type(part) is dict else ({"<not a field dict>"} if part else set())
                if unknown:
                    raise self._refuse(f"it sets {sorted(map(str, unknown))[:5]} on a {cls.__qualname__}")
        self._built.add(id(target))
        super().load_build()

    def _mutation_target(self, opcode: int) -> Any:
        """The object APPEND(S)/SETITEM(S)/ADDITEMS would change (as ``pickle._Unpickler`` finds it)."""
        if opcode == pickle.APPEND[0]:  # stack: ..., list, value
            return self.stack[-2] if len(self.stack) > 1 else None
        if opcode == pickle.SETITEM[0]:  # stack: ..., dict, key, value
            return self.stack[-3] if len(self.stack) > 2 else None
        below_mark = self.metastack[-1] if self.metastack else []  # APPENDS/SETITEMS/ADDITEMS: under the MARK
        return below_mark[-1] if below_mark else None

    def _refuse_construction(self) -> None:
        raise self._refuse("it constructs an object with INST/OBJ")


def _only_own_containers(opcode: int) -> Callable[[_StrictUnpickler], None]:
    """``opcode``'s handler, run only when its target is a container of the kind it expects that this load made."""
    original = _PythonUnpickler.dispatch[opcode]
    kind = _MUTATIONS[opcode]

    def handler(self: _StrictUnpickler) -> None:
        target = self._mutation_target(opcode)
        if type(target) is not kind or id(target) not in self._containers:
            raise self._refuse(f"it adds items to a {type(target).__name__} it did not create")
        original(self)

    return handler


_StrictUnpickler.dispatch.update(
    {opcode: _only_own_containers(opcode) for opcode in _MUTATIONS}
    | {
        pickle.EMPTY_LIST[0]: _StrictUnpickler.load_empty_list,
        pickle.EMPTY_DICT[0]: _StrictUnpickler.load_empty_dictionary,
        pickle.EMPTY_SET[0]: _StrictUnpickler.load_empty_set,
        pickle.LIST[0]: _StrictUnpickler.load_list,
        pickle.DICT[0]: _StrictUnpickler.load_dict,
        pickle.NEWOBJ[0]: _StrictUnpickler.load_newobj,
        pickle.NEWOBJ_EX[0]: _StrictUnpickler.load_newobj_ex,
        _BUILD: _StrictUnpickler.load_build,
        pickle.INST[0]: _StrictUnpickler._refuse_construction,
        pickle.OBJ[0]: _StrictUnpickler._refuse_construction,
    }
)


def _check(condition: bool, path: str, what: str) -> None:
    if not condition:
        raise CheckpointFormatError(f"{path}: not a checkpoint's metadata: {what}")


def _is_int(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _is_size(value: Any) -> bool:
    return type(value) is torch.Size and len(value) <= MAX_DIMS and all(_is_int(d) for d in value)


@functools.cache
def _field_names(cls: Any) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


@functools.cache
def _required_fields(cls: Any) -> frozenset[str]:
    fields = dataclasses.fields(cls)
    return frozenset(f.name for f in fields if f.default is f.default_factory is dataclasses.MISSING)


def _check_attributes(obj: Any, path: str, allowed: frozenset[str] = frozenset()) -> None:
    """Only the dataclass's own fields (and ``allowed``), and every field without a default present."""
    present, cls = vars(obj).keys(), obj.__class__
    extra = present - _field_names(cls) - allowed
    _check(not extra, path, f"a {cls.__name__} with unknown attributes {sorted(map(str, extra))[:5]}")
    missing = _required_fields(cls) - present
    _check(not missing, path, f"a {type(obj).__name__} without {sorted(missing)[:5]}")


def _check_properties(props: Any, path: str, key: str) -> None:
    _check(type(props) is TensorProperties, path, f"{key}: properties are a {type(props).__name__}")
    _check_attributes(props, path)
    _check(isinstance(props.dtype, torch.dtype), path, f"{key}: dtype {props.dtype!r}")
    _check(isinstance(props.layout, torch.layout), path, f"{key}: layout {props.layout!r}")
    _check(isinstance(props.memory_format, torch.memory_format), path, f"{key}: memory format")
    _check(type(props.requires_grad) is bool and type(props.pin_memory) is bool, path, f"{key}: flags")
    strides = getattr(props, "strides", None)
    _check(strides is None or (type(strides) is tuple and all(_is_int(s) for s in strides)), path, f"{key}: strides")


def _check_tensor(key: str, entry: TensorStorageMetadata, path: str) -> None:
    _check_attributes(entry, path)
    _check_properties(entry.properties, path, key)
    _check(_is_size(entry.size), path, f"{key}: size {entry.size!r}")
    _check(type(entry.chunks) is list, path, f"{key}: chunks are a {type(entry.chunks).__name__}")
    for chunk in entry.chunks:
        _check(type(chunk) is ChunkStorageMetadata, path, f"{key}: a chunk is a {type(chunk).__name__}")
        _check_attributes(chunk, path)
        _check(_is_size(chunk.offsets) and _is_size(chunk.sizes), path, f"{key}: chunk shape")
        _check(
            len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
            and all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)),
            path,
            f"{key}: chunk {list(chunk.offsets)}+{list(chunk.sizes)} outside {list(entry.size)}",
        )


def _check_storage(index: Any, info: Any, path: str) -> None:
    _check(type(index) is MetadataIndex and type(info) is _StorageInfo, path, "a storage entry of foreign types")
    _check_attributes(index, path)
    _check_attributes(info, path)
    _check(type(index.fqn) is str, path, f"storage index {index.fqn!r}")
    _check(index.offset is None or _is_size(index.offset), path, f"{index.fqn}: index offset")
    _check(index.index is None or _is_int(index.index), path, f"{index.fqn}: index")
    name = info.relative_path
    if type(name) is not str or not _PLAIN_FILE_NAME.fullmatch(name):
        raise UnsafeCheckpointError(
            f"{path}: refusing to load: item {index.fqn} is stored at {name!r}, which is not a file name inside "
            "the checkpoint's directory (a path elsewhere would read another run's or the system's files)"
        )
    _check(_is_int(info.offset) and _is_int(info.length), path, f"{index.fqn}: offset/length")
    transforms = getattr(info, "transform_descriptors", None)
    _check(not transforms, path, f"{index.fqn}: storage transforms {transforms!r} (this trainer writes none)")


def _check_files(metadata: Metadata, path: str, directory: Path) -> None:
    """Every storage file a regular file inside ``directory``; every item inside its file."""
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            try:
                found = os.lstat(directory / name)
            except FileNotFoundError:
                raise CheckpointFormatError(f"{directory / name}: missing (listed in {path})") from None
            if not stat.S_ISREG(found.st_mode):
                raise UnsafeCheckpointError(
                    f"{path}: refusing to load: {directory / name} is not a regular file (a link, FIFO or device)"
                )
            sizes[name] = found.st_size
        if info.offset + info.length > sizes[name]:
            raise CheckpointFormatError(
                f"{directory / name}: truncated or damaged: item {index.fqn} lies at bytes {info.offset}-"
                f"{info.offset + info.length} of a {sizes[name]}-byte file (as {path} lists it)"
            )


def check_metadata(metadata: Any, path: str, directory: Path) -> Metadata:
    """``metadata`` as decoded from ``path``, checked whole; megatron's save plans dropped."""
    _check(type(metadata) is Metadata, path, f"it holds a {type(metadata).__name__}")
    _check_attributes(metadata, path, frozenset({"all_local_plans"}))
    plans = vars(metadata).pop("all_local_plans", [])
    _check(type(plans) is list and all(type(p) is SavePlan for p in plans), path, "megatron's save plans")
    _check(type(metadata.state_dict_metadata) is dict, path, "state_dict_metadata")
    for key, entry in metadata.state_dict_metadata.items():
        _check(type(key) is str, path, f"an item key {key!r}")
        if type(entry) is TensorStorageMetadata:
            _check_tensor(key, entry, path)
        else:
            _check(type(entry) is BytesStorageMetadata, path, f"{key}: a {type(entry).__name__}")
            _check_attributes(entry, path)
    _check(type(metadata.storage_data) is dict, path, "storage_data")
    for index, info in metadata.storage_data.items():
        _check_storage(index, info, path)
    meta = metadata.storage_meta
    if meta is not None:
        _check(type(meta) is StorageMeta, path, f"storage_meta is a {type(meta).__name__}")
        _check_attributes(meta, path)
        ids = (meta.checkpoint_id, meta.save_id, meta.load_id)
        _check(all(v is None or type(v) is str for v in ids), path, "storage_meta ids")
        _check(type(meta.modules) is list and all(type(m) is str for m in meta.modules), path, "storage_meta")
    _check(metadata.version is None or type(metadata.version) is str, path, "version")
    planner = metadata.planner_data
    _check(planner is None or type(planner) is dict, path, f"planner_data is a {type(planner).__name__}")
    _check_files(metadata, path, directory)
    return metadata


def read_metadata_safely(path: str | os.PathLike) -> Metadata:
    """DCP metadata from ``path``: decoded by the strict unpickler, then checked against its directory."""
    path = Path(path)
    try:
        found = os.lstat(path)
        if not stat.S_ISREG(found.st_mode):  # a FIFO would block the open, a device never end
            raise UnsafeCheckpointError(f"{path}: refusing to load: not a regular file (a link, FIFO or device)")
        if found.st_size > MAX_METADATA_BYTES:
            raise CheckpointFormatError(f"{path}: {found.st_size} bytes, more than a checkpoint's metadata")
        with open(path, "rb") as file:
            data = file.read(found.st_size)  # what is there, never what a header claims
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: missing") from None
    except OSError as error:
        raise CheckpointFormatError(f"{path}: cannot be read ({error})") from None
    try:
        decoded = _StrictUnpickler(data, str(path)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - every way a damaged file fails (MemoryError, KeyError...), named
        # a damaged file, or one a newer torch wrote with more fields per record
        detail = f"{type(error).__name__}: {str(error)[:200]}"
        raise CheckpointFormatError(f"{path}: not a readable checkpoint metadata file ({detail})") from None
    return check_metadata(decoded, str(path), path.parent)
