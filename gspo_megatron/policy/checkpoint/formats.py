"""How megatron-core lays out a distributed checkpoint, by version: which files a complete one holds.

torch-free (the run-directory claim checks a checkpoint before anything heavy is imported).

- megatron-core <= 0.16 keeps the common (non-sharded) state in ``common.pt``; its ``metadata.json``
  names a ``common_backend``;
- megatron-core >= 0.17 keeps it inside the DCP checkpoint as the byte object ``common_state``; its
  ``metadata.json`` names only the sharded backend.
Both write torch DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` shards, and ``metadata.json`` last.
The trainer state records which megatron-core wrote the checkpoint (``WRITTEN_BY_KEY``), so that a
load that fails across versions can say so.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

CONFIG_FILE = "metadata.json"  # megatron's CheckpointingConfig: backends and their versions
METADATA_FILE = ".metadata"  # torch DCP's index of every item
COMMON_STATE_FILE = "common.pt"  # the common state, megatron-core <= 0.16
COMMON_STATE_OBJECT = "common_state"  # the common state's object key inside DCP, megatron-core >= 0.17
WRITTEN_BY_KEY = "written_by"  # in the trainer state: {"megatron-core": ..., "torch": ...}
_CONFIG_MAX_BYTES = 1 << 16  # metadata.json holds four short fields


class CheckpointFormatError(RuntimeError):
    """A checkpoint directory is not laid out as megatron-core writes one (missing, damaged or foreign files)."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file asked for something other than plain checkpoint data (code, a change to an
    existing object, a file outside its directory)."""


def common_state_in_file(directory: str | Path) -> bool:
    """Whether the checkpoint keeps its common state in ``common.pt`` (megatron-core <= 0.16 wrote it)
    rather than inside DCP (>= 0.17), as its ``metadata.json`` declares."""
    path = Path(directory) / CONFIG_FILE
    try:
        with open(path, "rb") as file:
            text = file.read(_CONFIG_MAX_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path} is missing") from None
    except OSError as error:
        raise CheckpointFormatError(f"{path} cannot be read ({error})") from None
    try:
        config = json.loads(text) if len(text) <= _CONFIG_MAX_BYTES else None
    except ValueError:
        config = None
    if not isinstance(config, dict) or config.get("sharded_backend") != "torch_dist":
        raise CheckpointFormatError(
            f"{path} does not describe a torch_dist checkpoint (megatron's format): it starts {text[:120]!r}"
        )
    return "common_backend" in config


def model_files(directory: str | Path) -> tuple[str, ...]:
    """The files megatron reads from a checkpoint's model directory, by the format it declares."""
    in_file = common_state_in_file(directory)
    return (CONFIG_FILE, METADATA_FILE, COMMON_STATE_FILE) if in_file else (CONFIG_FILE, METADATA_FILE)


def installed_versions() -> dict[str, str]:
    """What writes a checkpoint now: recorded in its trainer state under ``WRITTEN_BY_KEY``."""
    found = {}
    for package in ("megatron-core", "torch"):
        try:
            found[package] = version(package).split("+")[0]  # the release, not the build (2.13.0+cpu)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found


def written_by(state: dict, directory: str | Path) -> dict[str, str]:
    """Which megatron-core wrote a checkpoint: its record, or for checkpoints from before the record,
    what its format says ('<= 0.16' for ``common.pt``, '>= 0.17' otherwise)."""
    recorded = state.get(WRITTEN_BY_KEY)
    if isinstance(recorded, dict) and all(isinstance(v, str) for v in recorded.values()):
        return recorded
    try:
        return {"megatron-core": "<= 0.16" if common_state_in_file(directory) else ">= 0.17"}
    except CheckpointFormatError:
        return {"megatron-core": "unknown"}
