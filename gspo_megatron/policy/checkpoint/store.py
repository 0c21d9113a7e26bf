"""Atomic, resumable checkpoints with megatron-core distributed checkpointing.

Layout: ``<run>/checkpoints/step_000010/`` holding ``model_optim/`` (megatron ``dist_checkpointing``:
model and optimizer, sharded by whatever layout wrote them) and ``trainer_state.pt`` (step,
scheduler, task position, per-rank RNG states, the run's config, adaptive-clip and prefetched-rollout
state), plus ``<run>/checkpoints/latest`` naming the newest complete checkpoint. The metric history
is not in the checkpoint: it stays in ``<run>/metrics.jsonl`` and ``<run>/routing.jsonl``.

Atomicity: everything is written into ``step_000010.partial`` and renamed into place only after
every rank finished writing; ``latest`` is replaced with ``os.replace`` after that. A crash at any
point leaves the previous checkpoint and ``latest`` untouched; leftover ``.partial`` directories
are removed on the next save. Old checkpoints beyond ``keep_last`` are deleted only after the new
one is complete, and only this run's: each checkpoint names its run in ``run_id`` (a resumed run
keeps its id), so checkpoints a run found in its directory are never pruned by it.

No checkpoint file can run code when loaded: trainer state is plain data (numbers, strings,
tensors) loaded with ``weights_only=True``; ``model_optim/`` is read by ``checkpoint_reader.py``
(DCP's ``.metadata`` through an allow-listed unpickler, ``_extra_state`` and the common state as
weights only), not by megatron's default loader, which unpickles both without restriction.

Versions: megatron-core 0.16 and 0.17+ lay the checkpoint out differently (``checkpoint_format.py``);
the reader takes both. The trainer state records the megatron-core and torch that wrote it, and a load
that fails names them beside the ones installed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gspo_megatron.core.run_dir import RunDirError, write_run_file
from gspo_megatron.policy.checkpoint.formats import WRITTEN_BY_KEY, installed_versions, written_by

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    from gspo_megatron.policy.models.chunks import ModelChunks

STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model_optim"
RUN_ID_FILE = "run_id"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


_STEP_NAME = re.compile(r"step_\d{6,}")


class LatestPointerError(RunDirError):
    """``checkpoints/latest`` does not name a complete checkpoint of this run directory."""


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names: always a ``step_NNNNNN`` directory of this run
    directory's ``checkpoints/`` (never a path elsewhere), holding a trainer state."""
    root = checkpoint_root(run_dir)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    with open(pointer, "rb") as file:
        raw = file.read(256)
    name = raw.decode("utf-8", errors="replace").strip()
    fix = f"write the name of a complete checkpoint of this run (a step_NNNNNN directory in {root}) into it"
    if not name:
        raise LatestPointerError(f"{pointer} is empty (a write was cut short); {fix}")
    if not _STEP_NAME.fullmatch(name):
        raise LatestPointerError(f"{pointer} names {name[:100]!r}, which is not a checkpoint of {root}; {fix}")
    path = root / name
    if not (path / STATE_FILE).is_file():
        raise LatestPointerError(f"{pointer} names {name}, which is not a complete checkpoint; {fix}")
    return path


# megatron's distributed optimizer writes its shards in this format; its default
# ('fully_sharded_model_space') is refused by megatron-core 0.16's own dist checkpointing
# ("ShardedTensor.flattened_range is not supported"). The plain optimizer ignores the key.
OPTIMIZER_CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


DISTRIBUTED_KEY = "distributed_optimizer"  # in the trainer state: which optimizer wrote the checkpoint


def is_distributed(optimizer: MegatronOptimizer) -> bool:
    """Whether megatron's distributed optimizer (sharded state) is in use."""
    return any(part.config.use_distributed_optimizer for part in getattr(optimizer, "chained_optimizers", [optimizer]))


def check_optimizer_kind(path: Path, state: dict, optimizer: MegatronOptimizer) -> None:
    """Refuse, before anything is read, to load one optimizer's state into the other.

    The distributed optimizer's state resumes on any data-parallel size (megatron reshards its
    'dp_reshardable' format), the plain optimizer's too; between the two the formats differ. With
    ``optimizer.distributed=auto`` a different data-parallel size can flip the choice, hence the fix
    named in the error. Checkpoints written before the key existed came from the plain optimizer.
    """
    saved, now = bool(state.get(DISTRIBUTED_KEY, False)), is_distributed(optimizer)
    if saved != now:
        raise RuntimeError(
            f"{path} was written with optimizer.distributed={str(saved).lower()} but this run resolves "
            f"optimizer.distributed to {str(now).lower()} (auto = on when dp x cp > 1); "
            f"resume with optimizer.distributed={str(saved).lower()}"
        )


def _sharded_state(
    model: ModelChunks | DistributedDataParallel, optimizer: MegatronOptimizer, is_loading: bool
) -> dict[str, Any]:
    """Model state under ``ModelChunks.state_keys`` (``model``; ``model0``, ``model1``, ... under virtual
    pipeline stages) and the optimizer's, as Megatron-LM's ``generate_state_dict`` lays them out."""
    from gspo_megatron.policy.models.chunks import as_model_chunks

    state = as_model_chunks(model).sharded_state_dict()
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=OPTIMIZER_CHECKPOINT_METADATA
    )
    if not is_loading:
        zero_bucket_padding(state["optimizer"])
    return state


def zero_bucket_padding(optimizer_state: Any) -> int:
    """Zero the padding between parameters in the distributed optimizer's bucket-space state; returns the
    pieces zeroed.

    megatron's ``dp_reshardable`` format saves each bucket whole, the gaps between parameters included
    (``DistributedOptimizer.sharded_param_state_dp_reshardable`` fills them with ``torch.empty``: whatever
    the allocator left there), so two runs of the same job wrote checkpoints that differed in those
    elements and nowhere else. A padding piece is an entry whose ``padding`` flag megatron wraps in a
    ``LocalNonpersistentObject`` (not saved); its tensors are fresh, so zeroing them changes no state. A
    load never reads the padding (megatron copies each parameter's range)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    zeroed = 0
    pending = [optimizer_state]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            flag = node.get("padding")
            if isinstance(flag, LocalNonpersistentObject) and flag.unwrap() is True:
                for value in node.values():
                    if isinstance(value, ShardedTensor):
                        value.data.zero_()
                zeroed += 1
                continue
            pending.extend(node.values())
        elif isinstance(node, list | tuple):
            pending.extend(node)
    return zeroed


def read_trainer_state(path: Path) -> dict:
    """A checkpoint's trainer state (plain data only: ``weights_only`` loading; the one class allowed
    is the prefetched ``RolloutBatch`` of an asynchronous rollout, a dataclass of tensors)."""
    from gspo_megatron.contracts.batch import RolloutBatch

    with torch.serialization.safe_globals([RolloutBatch]):
        return torch.load(path / STATE_FILE, weights_only=True)


def forked_write_results_queue() -> None:
    """Serve megatron's checkpoint-writer results from a manager forked from this process, not spawned.

    megatron's writers (forked per save) report to a queue that a ``multiprocessing`` manager serves;
    megatron starts it with spawn at the first save (``filesystem_async``: ``_get_write_results_queue``
    in 0.16, ``get_write_results_queue`` in 0.17+, both caching it in ``_results_queue``). The first
    result it unpickles (DCP's ``WriteResult``) imports torch in that fresh interpreter: 2.2 s of the
    run's first save on 2 cores (cProfile: the ``put``), the main job's final save being its only one.
    A forked manager has torch already. megatron forks its writers from this same thread; the manager
    serves a socket and never touches an accelerator. A no-op once a queue exists, or where a megatron
    without that cache would make its own.
    """
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: ModelChunks | DistributedDataParallel,
    optimizer: MegatronOptimizer,
    trainer_state: dict,
    keep_last: int,
    is_driver: bool,
    run_id: str = "",
) -> Path:
    from megatron.core import dist_checkpointing

    root = checkpoint_root(run_dir)
    final = root / f"step_{step:06d}"
    partial = root / f"step_{step:06d}.partial"
    if is_driver:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.partial"):
            shutil.rmtree(stale)
        (partial / MODEL_DIR).mkdir(parents=True)
    dist.barrier()
    forked_write_results_queue()
    with _disk_full_named(partial, run_dir):
        dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(partial / MODEL_DIR))
    rng = {"torch": torch.get_rng_state()}
    states: list[dict | None] | None = [None] * dist.get_world_size() if is_driver else None
    dist.gather_object(rng, states, dst=0)
    if is_driver:
        written = {
            "step": step,
            "rng_per_rank": states,
            "run_id": run_id,
            DISTRIBUTED_KEY: is_distributed(optimizer),
            WRITTEN_BY_KEY: installed_versions(),
        }
        with _disk_full_named(partial, run_dir):
            torch.save({**trainer_state, **written}, partial / STATE_FILE)
            (partial / RUN_ID_FILE).write_text(run_id)
        if final.exists():
            _replace_own_or_keep_other(final, run_id)
        os.replace(partial, final)
        tmp_pointer = root / "latest.tmp"
        write_run_file(tmp_pointer, final.name)  # never through a link planted at latest.tmp
        os.replace(tmp_pointer, root / "latest")
        _prune(root, keep_last, run_id)
    dist.barrier()
    return final


class CheckpointDiskFullError(OSError):
    """A checkpoint could not be written for want of space: names the device's path and the bytes needed."""


def _directory_bytes(path: Path) -> int:
    total = 0
    for file in path.rglob("*"):
        with contextlib.suppress(OSError):
            if file.is_file():
                total += file.stat().st_size
    return total


@contextlib.contextmanager
def _disk_full_named(partial: Path, run_dir: Path) -> Iterator[None]:
    """Turn a write that failed for want of space into one error naming the path and the bytes needed (and
    one past the file-size limit into one naming the path, the limit and the fix: ``_file_too_large``).

    torch's zip writer and megatron's writer threads lose the errno ("unexpected pos 704 vs 598",
    "Worker failure"), so a failed write is judged by the device instead: ENOSPC anywhere in the chain,
    or less space free than the checkpoint still needed. The estimate is the size of the last complete
    checkpoint of this run (same model and layout), else what this save had written when it failed."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        yield
    except (Exception, CheckpointException) as error:  # any writer error; re-raised unless the device is full
        chain: list[BaseException] = []
        cause: BaseException | None = error
        while cause is not None and len(chain) < 16:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        if any(getattr(e, "errno", None) == errno.EFBIG or os.strerror(errno.EFBIG) in str(e) for e in chain):
            raise _file_too_large(partial, run_dir) from error
        no_space = any(getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e) for e in chain)
        written = _directory_bytes(partial)
        free = shutil.disk_usage(partial if partial.exists() else partial.parent).free
        try:
            previous = latest_checkpoint(run_dir)
        except RunDirError:
            previous = None
        needed = _directory_bytes(previous) if previous is not None else written
        if not no_space and free >= max(needed - written, 1 << 20):
            raise
        kept = f"{previous} is still the latest complete checkpoint" if previous else "no earlier checkpoint exists"
        raise CheckpointDiskFullError(
            errno.ENOSPC,
            f"no space left on the device holding {partial}: a checkpoint of this run needs about {needed} bytes, "
            f"{written} were written before the failure and {free} are free; nothing written so far is lost "
            f"({kept}; the incomplete {partial.name} is removed at the next save). Free space there, lower "
            f"checkpoint.keep_last, or resume in another run_dir copied from this one",
        ) from error


def _file_too_large(partial: Path, run_dir: Path) -> OSError:
    """A checkpoint file went past the process's file-size limit (``ulimit -f``; megatron's writers report
    only "Worker failure: [Errno 27] File too large"): the path, the limit, the largest file written, the fix."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    files = [f for f in partial.rglob("*") if f.is_file()] if partial.exists() else []
    largest = max((f.stat().st_size for f in files), default=0)
    try:
        previous = latest_checkpoint(run_dir)
    except RunDirError:
        previous = None
    kept = f"{previous} is still the latest complete checkpoint" if previous else "no earlier checkpoint exists"
    again = "continue with checkpoint.resume=true" if previous else "start again with checkpoint.overwrite=true"
    limit_text = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
    return OSError(
        errno.EFBIG,
        f"a checkpoint file in {partial} went past this process's file-size limit (ulimit -f: {limit_text}; "
        f"the largest file written there has {largest} bytes); nothing written before is lost ({kept}; the "
        f"incomplete {partial.name} is removed at the next save). Raise the limit in the shell that starts the "
        f"run (`ulimit -f unlimited`) and {again}",
    )


def checkpoint_run_id(path: Path) -> str:
    """The run that wrote a checkpoint ('' for checkpoints written before runs had ids)."""
    marker = path / RUN_ID_FILE
    return marker.read_text().strip() if marker.is_file() else ""


def _replace_own_or_keep_other(final: Path, run_id: str) -> None:
    """Make room for this run's ``final``: a checkpoint of the same run is replaced; another run's
    (``checkpoint.overwrite=true`` into its directory) is moved aside, never deleted."""
    other = checkpoint_run_id(final)
    if other == run_id:
        shutil.rmtree(final)
        return
    kept = final.with_name(f"{final.name}.run_{other or 'unknown'}")
    for copy in range(1, 1000):  # the same run's step moved aside before (a third run in this directory)
        if not kept.exists():
            break
        kept = final.with_name(f"{final.name}.run_{other or 'unknown'}.{copy}")
    os.replace(final, kept)
    print(f"[gspo] {final.name} of another run moved to {kept} (checkpoints of other runs are kept)")


def _prune(root: Path, keep_last: int, run_id: str) -> None:
    if keep_last < 1:
        return
    complete = sorted(
        p
        for p in root.glob("step_*")
        if p.is_dir() and not p.name.endswith(".partial") and checkpoint_run_id(p) == run_id
    )
    for old in complete[:-keep_last]:
        shutil.rmtree(old)


class CheckpointVersionError(RuntimeError):
    """megatron could not load a checkpoint; the message says which megatron-core and torch wrote it and
    which run now, so a version difference is named rather than left to an error from inside DCP."""

    def __init__(self, path: Path, state: dict, error: Exception) -> None:
        wrote, now = written_by(state, path / MODEL_DIR), installed_versions()
        differ = {k: (wrote.get(k, "unknown"), v) for k, v in now.items() if wrote.get(k, "unknown") != v}
        detail = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if differ:
            versions = "; ".join(f"{k} {old} wrote it, {new} reads it" for k, (old, new) in differ.items())
            advice = (
                f"the versions differ ({versions}): resume it with the versions that wrote it "
                "(docs/development.md, 'Tested versions'), or convert it to HF weights there "
                "(tools/convert_checkpoint.py) and start from those"
            )
        else:
            advice = "the same versions wrote it: the checkpoint is damaged; resume from an earlier one"
        super().__init__(f"checkpoint {path} could not be loaded ({detail}); {advice}")


def load_checkpoint(path: Path, model: ModelChunks | DistributedDataParallel, optimizer: MegatronOptimizer) -> dict:
    """Restore model and optimizer in place (any layout); returns the trainer state dict."""
    from gspo_megatron.policy.checkpoint.reader import UnsafeCheckpointError, load_dist_checkpoint
    from gspo_megatron.policy.models.chunks import as_model_chunks
    from gspo_megatron.policy.optimizer import allocate_optimizer_state, restore_adam_steps

    state = read_trainer_state(path)
    check_optimizer_kind(path, state, optimizer)
    allocate_optimizer_state(optimizer)
    try:
        loaded = load_dist_checkpoint(_sharded_state(model, optimizer, is_loading=True), path / MODEL_DIR)
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # megatron's and DCP's load errors, re-raised naming the versions
        raise CheckpointVersionError(path, state, error) from error
    as_model_chunks(model).load_state_dict(loaded)
    # no_grad: with fp32 weights the distributed optimizer's main weights are views of the model's
    # (leaf, requires_grad) parameters, which megatron copies the loaded shards into in place
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_steps(optimizer)
    rank = dist.get_rank()
    per_rank = state.get("rng_per_rank") or []
    if rank < len(per_rank) and per_rank[rank] is not None:
        torch.set_rng_state(per_rank[rank]["torch"])
    return state
