"""One owner per run directory: an exclusive lock, and the rules for what a run may do in a directory.

Design decisions:
- The lock is a file (``<run>/.gspo.lock``) holding the owner's host, pid and process start time,
  created atomically (written to a temporary name, then ``os.link``ed, which fails if the lock
  exists), so a lock file is never half-written. A stale lock is removed by one process at a time
  (under ``.gspo.lock.takeover``, itself linked into place) and only if the file there is still the
  one judged stale (its inode and bytes): of processes racing for one directory exactly one owns it.
  ``flock`` would release itself on death, but it is unreliable on the network file systems clusters
  share run directories over.
- A lock is stale when its host is this host and its pid is gone (or now belongs to a younger
  process: pid reuse), or when it names no owner at all (empty or not JSON: never one of ours, as
  ours are linked into place complete). A lock held from another host is never taken over; the
  error names the host and pid and says how to clear it.
- A fresh run refuses a directory that already holds a run's files (checkpoints, metrics, config)
  unless ``checkpoint.overwrite=true``; resuming is ``checkpoint.resume=true`` (a checkpoint must
  exist) or ``auto`` (resume if there is one). A directory whose run stopped before its first
  checkpoint has nothing to resume: both modes say so and name the one way on (overwrite). A
  checkpoint is checked before it is resumed (``checkpoint_check.py``), and one without its saved
  config is resumed only with ``checkpoint.allow_resume_without_config=true`` (nothing to compare).
- Every refusal happens before anything is built or written, on the driver only (rank 0 owns the
  directory); a directory the claim had to create is removed again on refusal. The directory and
  ``checkpoints/`` are checked writable at the claim, not at the first save.
- A run directory must be the user's own: one owned by another user, or holding symbolic links
  (anywhere below it but inside ``wandb/``, whose links wandb makes), is refused before anything is
  written, naming them. A directory pre-made in shared scratch could otherwise hold links that turn the
  run's writes onto the user's own files. A link planted after this check is not followed either: the
  files the run writes itself are opened through ``core/run_dir.py:open_run_file`` (O_NOFOLLOW). The path given as
  ``run_dir`` may itself be a link (a scratch directory on another disk) if the link is the user's too.
- A run has an id, written beside each of its checkpoints; pruning deletes only checkpoints with
  this run's id, so an overwriting run never deletes (or is deleted by) what it found.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import stat
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gspo_megatron.core.run_dir import (
    CONFIG_FILE,
    METRICS_FILE,
    ROUTING_FILE,
    ResumeMode,
    RunDirError,
    resume_mode,
    write_run_file,
)

if TYPE_CHECKING:
    from gspo_megatron.config.schema import CheckpointSection

LOCK_FILE = ".gspo.lock"
# what a run writes: a directory holding any of these holds a run
RUN_FILES = (CONFIG_FILE, METRICS_FILE, ROUTING_FILE, "checkpoints", "hf_export", "tensorboard")


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after "pid (comm) ": field 3 (the state) first; None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), or None where /proc cannot say."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None  # field 22


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` can still hold a lock: it exists and is not a zombie. A killed holder stays a
    zombie until its parent (or init, for an orphan) reaps it; it can write nothing any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    fields = _stat_fields(pid)
    return not fields or fields[0] not in ("Z", "X")


TAKEOVER_FILE = f"{LOCK_FILE}.takeover"  # held while one process removes a stale lock
TAKEOVER_WAIT_S = 10.0  # a take-over lasts milliseconds; waiting longer means its holder is stuck


@dataclass
class RunDirLock:
    path: Path
    owner: dict

    @classmethod
    def acquire(cls, run_dir: Path) -> RunDirLock:
        """Link a complete lock file into place; a stale or ownerless lock is removed first, by one
        process at a time (``_remove_if_unchanged``), so racing processes end with exactly one owner."""
        path = run_dir / LOCK_FILE
        me: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid())}
        tmp = run_dir / f"{LOCK_FILE}.{me['host']}.{me['pid']}.{uuid.uuid4().hex[:8]}"
        try:  # the run's first write: a read-only mount or a directory not ours is named here
            run_dir.mkdir(parents=True, exist_ok=True)
            write_run_file(tmp, json.dumps(me), new=True)
        except OSError as error:
            raise not_writable(run_dir, error) from None
        try:
            for _ in range(3):  # a second and third try after a stale lock was removed
                try:
                    os.link(tmp, path)
                    return cls(path, me)
                except FileExistsError:
                    pass
                observed = _observe(path)
                if observed is None:  # released meanwhile: try again
                    continue
                holder, judged = observed
                if holder and not _is_stale(holder, me["host"]):
                    raise RunDirError(
                        f"run_dir {run_dir} is in use by pid {holder.get('pid')} on host {holder.get('host')} "
                        f"(lock {path}); two runs must not share a run_dir. If that process is gone, delete "
                        f"{path}; otherwise choose another run_dir"
                    ) from None
                if _remove_if_unchanged(path, judged, me) and not holder:
                    print(f"[gspo] {path} names no owner (empty or damaged): taking it over", file=sys.stderr)
        finally:
            tmp.unlink(missing_ok=True)
        raise RunDirError(f"could not take the lock {path}: another run took it first")

    def release(self) -> None:
        """Remove the lock if it is still ours (safe to call twice)."""
        if _read_holder(self.path) == self.owner:
            self.path.unlink(missing_ok=True)


def _observe(path: Path) -> tuple[dict, tuple[int, bytes]] | None:
    """The lock's holder, and what identifies the file judged (inode and bytes: a freed inode number is
    soon reused, a file's bytes name its holder), or None when there is no lock."""
    try:
        inode = os.stat(path).st_ino
        raw = path.read_bytes()[:4096]
    except FileNotFoundError:
        return None
    return _read_holder(path), (inode, raw)


def _remove_if_unchanged(path: Path, judged: tuple[int, bytes], me: dict) -> bool:
    """Remove the lock at ``path`` only if it is still the file judged stale (same inode and bytes),
    under the take-over guard: only one process removes at a time, and a lock linked by a winner
    meanwhile names its live holder, so it is never removed. (Processes only ever link a lock into a
    free path or remove one here, so the file cannot change between this check and the removal.)"""
    guard = path.with_name(TAKEOVER_FILE)
    mine = path.with_name(f"{TAKEOVER_FILE}.{me['pid']}.{uuid.uuid4().hex[:8]}")
    write_run_file(mine, json.dumps(me), new=True)
    deadline = time.monotonic() + TAKEOVER_WAIT_S
    try:
        while True:
            try:
                os.link(mine, guard)
                break
            except FileExistsError:
                holder = _read_holder(guard)
                if holder and _is_stale(holder, me["host"]):  # its owner died inside a take-over
                    guard.unlink(missing_ok=True)
                elif time.monotonic() > deadline:
                    raise RunDirError(
                        f"{guard} has been held for {TAKEOVER_WAIT_S:.0f} s by pid {holder.get('pid')} on host "
                        f"{holder.get('host')}: another process is stuck taking over {path}; delete {guard} "
                        "if no run is starting in this directory"
                    ) from None
                time.sleep(0.005)
        now = _observe(path)
        if now is None or now[1] != judged:
            return False  # gone, or another process took it over first: judge the new lock again
        path.unlink()
        return True
    finally:
        if _read_holder(guard) == me:
            guard.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


def _read_holder(path: Path) -> dict:
    """The owner a lock file names ({} when it names none: missing, empty or not a JSON object)."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


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


def check_fresh_start(run_dir: Path, overwrite: bool, mode: str = "false") -> None:
    """A fresh run may not enter a directory holding another run unless told to overwrite."""
    found = existing_run_files(run_dir)
    if not found or overwrite:
        return
    if mode == ResumeMode.auto:  # resume was asked for, and there is nothing to resume
        raise RunDirError(
            f"run_dir {run_dir} holds a run ({', '.join(found)}) but no checkpoint to resume "
            "(checkpoint.resume=auto): that run stopped before its first save. Start over in it with "
            "checkpoint.overwrite=true (its metrics are replaced), or choose another run_dir"
        )
    raise RunDirError(
        f"run_dir {run_dir} already holds a run ({', '.join(found)}) and checkpoint.resume is off. "
        "Continue it with checkpoint.resume=true (or auto), choose another run_dir, or start over in it "
        "with checkpoint.overwrite=true (its metrics are replaced; its checkpoints are kept, not pruned)"
    )


def _nothing_to_resume(run_dir: Path) -> RunDirError:
    """checkpoint.resume=true without a checkpoint: a wrong run_dir, or a run that never saved."""
    found = existing_run_files(run_dir)
    if found:
        return RunDirError(
            f"checkpoint.resume=true but {run_dir}/checkpoints holds no checkpoint: the run there "
            f"({', '.join(found)}) stopped before its first save, so there is nothing to resume. Start over "
            "in it with checkpoint.resume=false checkpoint.overwrite=true, or choose another run_dir"
        )
    return RunDirError(
        f"checkpoint.resume=true but {run_dir}/checkpoints holds no checkpoint (is run_dir right?); "
        "use checkpoint.resume=auto to start fresh when there is nothing to resume"
    )


def not_writable(directory: Path, error: OSError) -> RunDirError:
    """The error for a run directory (or its ``checkpoints/``) the OS refuses a file in: the directory,
    the OS's reason and the file it refused, and the fix."""
    refused = f" ({error.strerror}: {error.filename})" if error.filename else f" ({error.strerror or error})"
    return RunDirError(
        f"{directory} is not writable{refused}: a run writes its lock, metrics and checkpoints there, so it can "
        "neither start nor resume in it. Fix its permissions or mount (remount a read-only one read-write), "
        "or copy the run directory somewhere writable and pass that as run_dir="
    )


def check_writable(run_dir: Path) -> None:
    """The run directory and its checkpoints/ take files (probed: permissions, read-only mounts, root alike)."""
    for directory in (run_dir, run_dir / "checkpoints"):
        if not directory.exists():
            continue
        probe = directory / f".gspo_write_probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            write_run_file(probe, b"", new=True)
            probe.unlink()
        except OSError as error:
            raise not_writable(directory, error) from None


WRITTEN_BY_OTHERS = ("wandb",)  # subdirectories whose files another library writes (wandb links its logs)
NAMED_AT_MOST = 10  # entries a refusal names; the rest are counted


def check_own_run_dir(run_dir: Path) -> None:
    """Refuse a run directory that is not this user's own: owned (or named by a link owned) by another
    user, or holding symbolic links or entries of another user below it. Nothing is written. A path
    that does not exist yet passes: the claim creates it."""
    me = os.geteuid()
    owners = []
    if run_dir.is_symlink():
        owners.append(("the link naming it", os.lstat(run_dir).st_uid))
    if run_dir.exists():
        owners.append(("the directory", os.stat(run_dir).st_uid))
    for what, owner in owners:
        if owner != me:
            raise RunDirError(
                f"run_dir {run_dir}: {what} is owned by {_user(owner)}, not by you ({_user(me)}): a run directory "
                "someone else made can hold links that turn this run's writes onto your own files. Choose a "
                "run_dir of your own (a new path is created for you)"
            )
    links, foreign = _links_and_foreign_entries(run_dir, me)
    for found, what in ((links, "symbolic links"), (foreign, "entries owned by another user")):
        if found:
            named = ", ".join(str(path) for path in found[:NAMED_AT_MOST])
            more = f" and {len(found) - NAMED_AT_MOST} more" if len(found) > NAMED_AT_MOST else ""
            raise RunDirError(
                f"run_dir {run_dir} holds {what}: {named}{more}. A run never writes through a link or into "
                "another user's files (they could point at anyone's file, yours included): remove them, or "
                "choose another run_dir"
            )


def _links_and_foreign_entries(run_dir: Path, me: int) -> tuple[list[Path], list[Path]]:
    """Every symbolic link below ``run_dir`` and every entry another user owns (links not followed;
    the contents of ``WRITTEN_BY_OTHERS`` skipped)."""
    links: list[Path] = []
    foreign: list[Path] = []
    for root, dirs, files in os.walk(run_dir, followlinks=False):
        for name in dirs + files:
            path = Path(root) / name
            try:
                entry = os.lstat(path)
            except FileNotFoundError:  # removed meanwhile (a temporary file of a run still holding the lock)
                continue
            if stat.S_ISLNK(entry.st_mode):
                links.append(path)
            elif entry.st_uid != me:
                foreign.append(path)
        if Path(root) == run_dir:
            dirs[:] = [name for name in dirs if name not in WRITTEN_BY_OTHERS]
    return links, foreign


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _missing_parents(run_dir: Path) -> list[Path]:
    """The directories creating ``run_dir`` makes, deepest first."""
    missing = []
    for directory in [run_dir, *run_dir.parents]:
        if directory.exists():
            break
        missing.append(directory)
    return missing


def _remove_if_empty(directories: list[Path]) -> None:
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:  # not empty (someone else wrote there meanwhile): leave it
            return


@dataclass
class RunClaim:
    """What the driver holds for the length of a run: the lock, and the checkpoint it resumes (if any)."""

    lock: RunDirLock
    resume_from: Path | None
    accepted_changes: list[str]
    created: list[Path] = field(default_factory=list)  # the directories the claim made, deepest first

    def release(self) -> None:
        self.lock.release()


def claim_run_dir(run_dir: Path, section: CheckpointSection, config_yaml: str) -> RunClaim:
    """Lock ``run_dir`` and decide fresh vs resume by ``section`` (a ``CheckpointSection``), or refuse.

    Runs on the driver before anything is built: a refusal costs seconds and touches no file.
    """
    mode = resume_mode(section.resume)
    check_own_run_dir(run_dir)
    created = _missing_parents(run_dir)
    lock = RunDirLock.acquire(run_dir)
    try:
        check_writable(run_dir)
        claim = _decide(run_dir, mode, section, config_yaml, lock)
    except BaseException:
        lock.release()
        _remove_if_empty(created)
        raise
    claim.created = created
    return claim


def _decide(
    run_dir: Path, mode: ResumeMode, section: CheckpointSection, config_yaml: str, lock: RunDirLock
) -> RunClaim:
    from gspo_megatron.config.resume_check import check_resume_config
    from gspo_megatron.policy.checkpoint.check import checked_trainer_state
    from gspo_megatron.policy.checkpoint.store import latest_checkpoint

    latest = latest_checkpoint(run_dir) if mode is not ResumeMode.false else None
    if latest is None:
        if mode is ResumeMode.true:
            raise _nothing_to_resume(run_dir)
        check_fresh_start(run_dir, section.overwrite, mode)
        return RunClaim(lock, None, [])
    saved = checked_trainer_state(latest).get("config")
    if saved is None:
        if not section.allow_resume_without_config:
            raise RunDirError(
                f"refusing to resume {latest}: its trainer state holds no config to check this run's against "
                "(written by an older version, or altered), so a changed algorithm or optimizer would go "
                "unnoticed. Resume it unchecked with checkpoint.allow_resume_without_config=true"
            )
        print(f"[gspo] resuming {latest} without a config check (checkpoint.allow_resume_without_config=true)")
        return RunClaim(lock, latest, [])
    return RunClaim(lock, latest, check_resume_config(saved, config_yaml, section.resume_allow_changes, str(latest)))
