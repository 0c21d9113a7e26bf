"""One owner per run directory: an exclusive lock, and the rules for what a run may do in a directory.

Design decisions:
- The lock is a file (``<run>/.gspo.lock``) holding the owner's host, pid and process start time,
  created atomically (written to a temporary name, then ``os.link``ed, which fails if the lock
  exists), so a lock file is never half-written. ``flock`` would release itself on death, but it
  is unreliable on the network file systems clusters share run directories over.
- A lock is stale when its host is this host and its pid is gone (or now belongs to a younger
  process: pid reuse). A lock held from another host is never taken over; the error names the host
  and pid and says how to clear it.
- A fresh run refuses a directory that already holds a run's files (checkpoints, metrics, config)
  unless ``checkpoint.overwrite=true``; resuming is ``checkpoint.resume=true`` (a checkpoint must
  exist) or ``auto`` (resume if there is one). Every refusal happens before anything is built or
  written, on the driver only (rank 0 owns the directory).
- A run has an id, written beside each of its checkpoints; pruning deletes only checkpoints with
  this run's id, so an overwriting run never deletes (or is deleted by) what it found.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_megatron.routing.run_dir import CONFIG_FILE, METRICS_FILE, ROUTING_FILE

LOCK_FILE = ".gspo.lock"
# what a run writes: a directory holding any of these holds a run
RUN_FILES = (CONFIG_FILE, METRICS_FILE, ROUTING_FILE, "checkpoints", "hf_export", "tensorboard")
RESUME_MODES = ("false", "true", "auto")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (locked, holds another run, nothing to resume)."""


def resume_mode(value) -> str:
    """``checkpoint.resume`` as one of false | true | auto (Hydra hands booleans over as 'True')."""
    mode = str(value).strip().lower()
    if mode not in RESUME_MODES:
        raise RunDirError(f"checkpoint.resume={value!r} is not one of {list(RESUME_MODES)}")
    return mode


def new_run_id() -> str:
    return uuid.uuid4().hex


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), or None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]  # field 22, counted after "pid (comm) "


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


@dataclass
class RunDirLock:
    path: Path
    owner: dict

    @classmethod
    def acquire(cls, run_dir: Path) -> RunDirLock:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        me: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid())}
        for _ in range(2):  # a second try after clearing a stale lock
            tmp = run_dir / f"{LOCK_FILE}.{me['host']}.{me['pid']}"
            tmp.write_text(json.dumps(me))
            try:
                os.link(tmp, path)
                return cls(path, me)
            except FileExistsError:
                holder = _read_holder(path)
                if not _is_stale(holder, me["host"]):
                    raise RunDirError(
                        f"run_dir {run_dir} is in use by pid {holder.get('pid')} on host {holder.get('host')} "
                        f"(lock {path}); two runs must not share a run_dir. If that process is gone, delete "
                        f"{path}; otherwise choose another run_dir"
                    ) from None
                path.unlink(missing_ok=True)
            finally:
                tmp.unlink(missing_ok=True)
        raise RunDirError(f"could not take the lock {path}: another run took it first")

    def release(self) -> None:
        """Remove the lock if it is still ours (safe to call twice)."""
        if _read_holder(self.path) == self.owner:
            self.path.unlink(missing_ok=True)


def _read_holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _is_stale(holder: dict, host: str) -> bool:
    if holder.get("host") != host or not isinstance(holder.get("pid"), int):
        return False
    pid = holder["pid"]
    if not _pid_alive(pid):
        return True
    start = _process_start(pid)
    return start is not None and holder.get("start") is not None and start != holder["start"]


def existing_run_files(run_dir: Path) -> list[str]:
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def check_fresh_start(run_dir: Path, overwrite: bool) -> None:
    """A fresh run may not enter a directory holding another run unless told to overwrite."""
    found = existing_run_files(run_dir)
    if found and not overwrite:
        raise RunDirError(
            f"run_dir {run_dir} already holds a run ({', '.join(found)}) and checkpoint.resume is off. "
            "Continue it with checkpoint.resume=true (or auto), choose another run_dir, or start over in it "
            "with checkpoint.overwrite=true (its metrics are replaced; its checkpoints are kept, not pruned)"
        )


@dataclass
class RunClaim:
    """What the driver holds for the length of a run: the lock, and the checkpoint it resumes (if any)."""

    lock: RunDirLock
    resume_from: Path | None
    accepted_changes: list[str]

    def release(self) -> None:
        self.lock.release()


def claim_run_dir(run_dir: Path, section, config_yaml: str) -> RunClaim:
    """Lock ``run_dir`` and decide fresh vs resume by ``section`` (a ``CheckpointSection``), or refuse.

    Runs on the driver before anything is built: a refusal costs seconds and touches no file.
    """
    from gspo_megatron.trainer.checkpoint import latest_checkpoint, read_trainer_state
    from gspo_megatron.trainer.resume_check import check_resume_config

    mode = resume_mode(section.resume)
    lock = RunDirLock.acquire(run_dir)
    try:
        latest = latest_checkpoint(run_dir) if mode != "false" else None
        if latest is None:
            if mode == "true":
                raise RunDirError(
                    f"checkpoint.resume=true but {run_dir}/checkpoints holds no checkpoint (is run_dir right?); "
                    "use checkpoint.resume=auto to start fresh when there is nothing to resume"
                )
            check_fresh_start(run_dir, section.overwrite)
            return RunClaim(lock, None, [])
        saved = read_trainer_state(latest).get("config")
        accepted = (
            [] if saved is None else check_resume_config(saved, config_yaml, section.resume_allow_changes, str(latest))
        )
        return RunClaim(lock, latest, accepted)
    except BaseException:
        lock.release()
        raise
