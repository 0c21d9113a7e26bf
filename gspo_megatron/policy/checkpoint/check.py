"""A checkpoint is checked before a run resumes from it: each problem named with its file and what is wrong.

Design decisions:
- The driver checks the checkpoint when it claims the run directory, before anything is built: the
  files megatron reads exist (by the format megatron-core's ``metadata.json`` declares:
  ``checkpoint_format.py``), ``trainer_state.pt`` loads as plain data, and it holds the fields
  resume reads, of the types resume reads them as. A truncated, damaged, older or foreign file is
  refused naming the path and the fault; the advice is an earlier checkpoint or a fresh run, never
  a less safe loader (torch's own message suggests ``weights_only=False``: it is not passed on).
- After megatron has loaded the weights, every rank checks its parameters and its optimizer state
  (main weights, Adam moments) for NaN/inf (``parameters_finite``, ``optimizer_state_finite``: one
  all-reduce each): a poisoned checkpoint is refused when it is loaded, naming it and the tensor,
  instead of being found at the next save and blamed on training.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING

from gspo_megatron.core.run_dir import RunDirError
from gspo_megatron.policy.checkpoint.formats import CONFIG_FILE, CheckpointFormatError, model_files
from gspo_megatron.policy.checkpoint.store import MODEL_DIR, STATE_FILE, load_checkpoint, read_trainer_state

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    from gspo_megatron.policy.models.chunks import ModelChunks

# what resume reads from the trainer state, and as what; (type, required)
STATE_FIELDS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "step": (int, True),
    "scheduler": (dict, True),
    "config": (str, False),
    "run_id": (str, False),
    "task": ((dict, type(None)), False),
    "rng_per_rank": ((list, type(None)), False),
    "clip_controller": ((dict, type(None)), False),
    "rollout_scheduler": ((dict, type(None)), False),
    "partial_rollouts": ((dict, type(None)), False),
}


class CheckpointError(RunDirError):
    """The checkpoint a run would resume cannot be: the message names the file and what is wrong with it."""


def _fix(path: Path) -> str:
    return (
        f"resume from an earlier checkpoint (write its directory name into {path.parent / 'latest'}) "
        "or start a fresh run (another run_dir, or checkpoint.overwrite=true with checkpoint.resume=false)"
    )


def _unpickling_reason(error: Exception) -> str:
    """The line of torch's weights-only refusal that says what was refused (not its advice)."""
    lines = [line.strip() for line in str(error).splitlines()]
    found = [line for line in lines if "GLOBAL" in line or line.startswith("Unsupported")]
    return found[0] if found else "not a file torch.save wrote"


def _missing(path: Path, file: Path) -> CheckpointError:
    return CheckpointError(
        f"{file} is missing: checkpoint {path} is incomplete (copied or deleted in part); {_fix(path)}"
    )


def checked_trainer_state(path: Path) -> dict:
    """The trainer state of checkpoint ``path``, after checking the checkpoint is complete and readable."""
    model_dir = path / MODEL_DIR
    if not (model_dir / CONFIG_FILE).is_file():  # written last: without it nothing else is known
        raise _missing(path, model_dir / CONFIG_FILE)
    try:
        names = model_files(model_dir)
    except CheckpointFormatError as error:
        raise CheckpointError(f"checkpoint {path} is damaged: {error}; {_fix(path)}") from None
    for name in names:
        if not (model_dir / name).is_file():
            raise _missing(path, model_dir / name)
    file = path / STATE_FILE
    try:
        state = read_trainer_state(path)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{file} holds objects other than plain data ({_unpickling_reason(error)}): it was not written by "
            f"this trainer, or was altered; it is not loaded; {_fix(path)}"
        ) from None
    except Exception as error:  # noqa: BLE001 - torch reports a truncated or foreign file as EOFError, OSError, KeyError...
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise CheckpointError(f"{file} cannot be read ({detail}): it is truncated or damaged; {_fix(path)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a trainer state; {_fix(path)}")
    for key, (kind, required) in STATE_FIELDS.items():
        if key not in state:
            if required:
                raise CheckpointError(
                    f"{file} has no {key!r}: it was written by an older version of the trainer, or is damaged; "
                    f"{_fix(path)}"
                )
            continue
        value = state[key]
        negative_step = key == "step" and isinstance(value, int) and value < 0
        if not isinstance(value, kind) or isinstance(value, bool) or negative_step:
            raise CheckpointError(f"{file}: {key!r} is {value!r}, not a valid {key}; the file is damaged; {_fix(path)}")
    return state


def load_checked_checkpoint(
    path: Path, model: ModelChunks | DistributedDataParallel, optimizer: MegatronOptimizer
) -> dict:
    """``load_checkpoint``, then refuse weights that are not finite (collective: every rank decides alike)."""
    from gspo_megatron.policy.nonfinite import NonFiniteError, optimizer_state_finite, parameters_finite

    state = load_checkpoint(path, model, optimizer)
    if not parameters_finite(model):
        raise NonFiniteError(
            f"checkpoint {path} holds non-finite (NaN/inf) weights: it was damaged after it was written (this "
            f"trainer never saves non-finite weights); {_fix(path)}"
        )
    bad = optimizer_state_finite(optimizer, model)
    if bad is not None:
        raise NonFiniteError(
            f"checkpoint {path} holds non-finite (NaN/inf) optimizer state: {bad}; it was damaged after it was "
            f"written (this trainer never saves non-finite state); {_fix(path)}"
        )
    return state
