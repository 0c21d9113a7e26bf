"""A checkpoint's ``.metadata`` crafted to change the process, read elsewhere, hang or allocate is refused
by name, fast, with bounded memory, and leaves the process as it was (issue 43: N1, N2, N5, truncation).

Each test starts from a genuine DCP checkpoint written here (torch's own ``dcp.save``, one process).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import time
import tracemalloc
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.serialization
from torch.distributed.checkpoint.metadata import Metadata

from gspo_megatron.policy.checkpoint.formats import CheckpointFormatError, UnsafeCheckpointError
from gspo_megatron.policy.checkpoint.metadata import read_metadata_safely

MEMORY_BOUND = 64 << 20  # bytes the reader may allocate on any crafted file here (they are all < 1 MB)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    directory = tmp_path / "model_optim"
    state = {"weight": torch.arange(12.0).view(3, 4), "bias": torch.ones(4), "extra": io.BytesIO(b"plain")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    metadata = _genuine(directory)
    metadata.storage_meta.checkpoint_id = str(directory)  # a string, as megatron's writer records it
    _write(directory, pickle.dumps(metadata, protocol=4))
    return directory


def _genuine(checkpoint: Path) -> Metadata:
    return pickle.loads((checkpoint / ".metadata").read_bytes())  # our own file, written just now


def _write(checkpoint: Path, data: bytes) -> Path:
    path = checkpoint / ".metadata"
    path.write_bytes(data)
    return path


def _refused(path: Path, error: type[Exception], match: str) -> str:
    """Read ``path``: it must fail with ``error`` naming the file, in seconds and bounded memory."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(error) as info:
            read_metadata_safely(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 10  # refused at once (a generous bound for a loaded machine)
    assert peak < MEMORY_BOUND, peak
    message = str(info.value)
    assert str(path) in message and match in message, message
    return message


def _with_storage(checkpoint: Path, **changes) -> Path:
    metadata = _genuine(checkpoint)
    index = next(i for i in metadata.storage_data if i.fqn == "weight")
    metadata.storage_data[index] = replace(metadata.storage_data[index], **changes)
    return _write(checkpoint, pickle.dumps(metadata, protocol=4))


def test_genuine_metadata_reads_as_pickle_does(checkpoint):
    safe, plain = read_metadata_safely(checkpoint / ".metadata"), _genuine(checkpoint)
    assert safe.state_dict_metadata == plain.state_dict_metadata and safe.storage_data == plain.storage_data


# --- N1: BUILD (and item opcodes) only on objects the load itself created -------------------------------

GLOBAL_METADATA = b"ctorch.distributed.checkpoint.metadata\nMetadata\n"


def _build_on(target: bytes, attribute: str) -> bytes:
    """PROTO 4, push ``target``, state (None, {attribute: 1}), BUILD, STOP."""
    name = attribute.encode()
    state = b"N}" + b"\x8c" + bytes([len(name)]) + name + b"K\x01s" + b"\x86"
    return b"\x80\x04" + target + state + b"b."


@pytest.mark.parametrize(
    "target, owner",
    [
        (GLOBAL_METADATA, lambda: Metadata),
        (b"ctorch.serialization\n_get_layout\n", lambda: torch.serialization._get_layout),
    ],
    ids=["class", "function"],
)
def test_build_on_an_existing_object_is_refused_and_changes_nothing(checkpoint, target, owner):
    before = dict(vars(owner()))
    path = _write(checkpoint, _build_on(target, "gspo_marker"))
    _refused(path, UnsafeCheckpointError, "refusing to load: it sets attributes of an existing")
    assert dict(vars(owner())) == before and not hasattr(owner(), "gspo_marker")


def test_the_layout_cache_cannot_be_replaced(checkpoint):
    cache = torch.serialization._get_layout.cache
    path = _write(checkpoint, _build_on(b"ctorch.serialization\n_get_layout\n", "cache"))
    _refused(path, UnsafeCheckpointError, "sets attributes of an existing")
    assert torch.serialization._get_layout.cache is cache
    assert torch.serialization._get_layout("torch.strided") is torch.strided


def test_build_with_a_foreign_field_on_a_fresh_instance_is_refused(checkpoint):
    newobj = GLOBAL_METADATA + b")\x81"  # Metadata.__new__(Metadata): a fresh instance
    path = _write(checkpoint, _build_on(newobj, "__class__"))
    _refused(path, UnsafeCheckpointError, "it sets ['__class__'] on a Metadata")


def test_items_added_to_an_object_the_load_did_not_make_are_refused(checkpoint):
    appends = b"\x80\x04" + GLOBAL_METADATA + b"(K\x01e."  # MARK 1 APPENDS onto the Metadata class
    _refused(_write(checkpoint, appends), UnsafeCheckpointError, "adds items to a type it did not create")


def test_code_is_refused_by_name(checkpoint):
    payload = pickle.dumps(print, protocol=4)  # any global outside the allow-list
    _refused(_write(checkpoint, payload), UnsafeCheckpointError, "it references builtins.print")


# --- N2: storage paths, offsets and lengths checked against the directory before a byte is read --------


@pytest.mark.parametrize("path", ["/dev/zero", "../other_run/__0_0.distcp", "/tmp/other_run/__0_0.distcp", ""])
def test_a_storage_path_outside_the_checkpoint_is_refused(checkpoint, path):
    crafted = _with_storage(checkpoint, relative_path=path, length=3 << 30)
    _refused(crafted, UnsafeCheckpointError, "which is not a file name inside the checkpoint's directory")


@pytest.mark.timeout(60)
def test_a_fifo_or_a_link_is_refused_without_being_opened(checkpoint):
    os.mkfifo(checkpoint / "pipe")  # opening it for reading would block forever
    _refused(_with_storage(checkpoint, relative_path="pipe"), UnsafeCheckpointError, "is not a regular file")
    (checkpoint / "link").symlink_to("/dev/zero")
    _refused(_with_storage(checkpoint, relative_path="link"), UnsafeCheckpointError, "is not a regular file")


def test_an_item_beyond_its_file_is_named_as_truncation(checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    size = shard.stat().st_size
    path = _with_storage(checkpoint, offset=size - 8, length=3 << 30)
    _refused(path, CheckpointFormatError, f"{shard}: truncated or damaged: item weight lies at bytes {size - 8}-")


def test_a_truncated_shard_is_named_before_it_is_read(checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    _refused(checkpoint / ".metadata", CheckpointFormatError, f"{shard}: truncated or damaged")


def test_a_missing_shard_is_named(checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    shard.unlink()
    _refused(checkpoint / ".metadata", CheckpointFormatError, f"{shard}: missing")


# --- N5: every way a damaged index fails ends as one named error -----------------------------------------


def test_an_unknown_layout_is_named(checkpoint):
    data = (checkpoint / ".metadata").read_bytes()
    assert b"torch.strided" in data
    path = _write(checkpoint, data.replace(b"torch.strided", b"torch.nopexxx"))
    _refused(path, CheckpointFormatError, "not a readable checkpoint metadata file (KeyError")


READABLE = "not a readable checkpoint metadata file"


@pytest.mark.parametrize(
    "data, match",
    [
        # FRAME of 1 TiB around "None": Python's unpickler reads what is there and finds no Metadata
        (b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.", "it holds a NoneType"),
        (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"abc", READABLE),  # BINBYTES8 of 1 TiB
        (b"\x80\x04\x8d" + struct.pack("<Q", 1 << 40) + b"abc", READABLE),  # BINUNICODE8 of 1 TiB
        (b"\x80\x04(((((((((((((((((((((", READABLE),  # marks without an end
        (b"", READABLE),
    ],
    ids=["frame", "binbytes8", "binunicode8", "marks", "empty"],
)
def test_huge_or_broken_frames_are_named_with_bounded_memory(checkpoint, data, match):
    _refused(_write(checkpoint, data), CheckpointFormatError, match)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("storage_meta", 5, "storage_meta is a int"),
        ("version", ["1"], "version"),
        ("state_dict_metadata", [], "state_dict_metadata"),
        ("planner_data", print, "planner_data is a builtin_function_or_method"),
    ],
)
def test_fields_of_the_wrong_type_are_named(checkpoint, field, value, match):
    metadata = _genuine(checkpoint)
    setattr(metadata, field, value)
    data = pickle.dumps(metadata, protocol=4)
    if field == "planner_data":  # print itself is refused by find_class; a bare number reaches the check
        metadata.planner_data = 7
        data, match = pickle.dumps(metadata, protocol=4), "planner_data is a int"
    _refused(_write(checkpoint, data), CheckpointFormatError, match)


def test_a_chunk_outside_its_tensor_is_named(checkpoint):
    metadata = _genuine(checkpoint)
    chunk = metadata.state_dict_metadata["weight"].chunks[0]
    metadata.state_dict_metadata["weight"].chunks[0] = replace(chunk, sizes=torch.Size([30, 4]))
    _refused(_write(checkpoint, pickle.dumps(metadata, protocol=4)), CheckpointFormatError, "weight: chunk [0, 0]+[30")
