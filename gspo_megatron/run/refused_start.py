"""A refused start-up: its message without a traceback, and no run directory left behind by it.

Design decisions:
- A refusal is an error of one of the classes in ``REFUSALS``: the project raises them on purpose,
  each message names the key or path and the fix, so a traceback only hides it. Every other exception
  (a bug, a library's error, a plain ``ValueError``) keeps its traceback. ``HYDRA_FULL_ERROR=1``,
  Hydra's own switch, shows the traceback of a refusal too.
- The classes are named by module and class name, not imported: an exception of a class exists only
  if its module was imported, so ``sys.modules`` tells without importing megatron-core to print a
  config error.
- A run directory this run created (the claim's ``mkdir``, or Hydra's timestamped directory when
  ``run_dir=`` is not given) that holds only the start-up record (Hydra's ``.hydra/`` files and
  ``train.log``) when the start fails is removed, record and all. A directory holding anything
  else, or one the run did not create, is left exactly as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

# (module, class): the project's own start-up refusals; subclasses count (CheckpointError is a RunDirError)
REFUSALS: tuple[tuple[str, str], ...] = (
    ("gspo_megatron.config.validate", "ConfigError"),
    ("gspo_megatron.config.known_keys", "UnknownConfigKeyError"),
    ("gspo_megatron.config.resume_check", "ResumeConfigError"),
    ("gspo_megatron.core.run_dir", "RunDirError"),
    ("gspo_megatron.core.registry", "UnknownNameError"),
    ("gspo_megatron.policy.parallel.layout", "LayoutError"),
    ("gspo_megatron.policy.models.config", "ModelConfigError"),
    ("gspo_megatron.policy.models.hf_checkpoint", "HFCheckpointError"),
)
FULL_ERROR_VARIABLE = "HYDRA_FULL_ERROR"
# what Hydra and keep_hydra_output write before the run's own files (relative to the run directory)
STARTUP_RECORD = frozenset({".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "train.log"})


def is_refusal(error: BaseException) -> bool:
    """True for an error of a class in ``REFUSALS`` (or a subclass of one)."""
    for module_name, class_name in REFUSALS:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(error, getattr(module, class_name)):
            return True
    return False


def wants_traceback() -> bool:
    return os.environ.get(FULL_ERROR_VARIABLE) == "1"  # Hydra's own test of the same variable


def refusal_message(error: BaseException) -> str:
    return f"[gspo] error: {error}\n(set {FULL_ERROR_VARIABLE}=1 for the traceback)"


def remove_startup_record(run_dir: Path, created: Iterable[Path]) -> bool:
    """Remove ``run_dir`` if this run created it (it is in ``created``, deepest first) and it holds only
    the start-up record; the other directories in ``created`` go too while empty. True if removed."""
    created = list(created)
    if run_dir not in created or not run_dir.is_dir() or run_dir.is_symlink():
        return False
    found = {str(path.relative_to(run_dir)) for path in run_dir.rglob("*") if not path.is_dir() or path.is_symlink()}
    directories = {str(path.relative_to(run_dir)) for path in run_dir.rglob("*") if path.is_dir()}
    if not found <= STARTUP_RECORD or not directories <= {".hydra"}:
        return False
    for name in found:
        (run_dir / name).unlink(missing_ok=True)
    for directory in [run_dir / ".hydra", *created]:
        try:
            directory.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # written to meanwhile: leave it and what holds it
            break
    return not run_dir.exists()
