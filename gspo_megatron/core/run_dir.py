"""The run-directory format shared by the trainer, the routing report and ``tools/compare_runs.py``
(torch-free; ``policy/routing/log.py`` writes the routing records into it).

Layout of one run directory (the trainer writes it from rank 0 only; everything else reads it)::

    <run>/config.yaml     resolved Hydra config; ``algorithm.name`` names the algorithm
                          (e.g. "gspo", "grpo"); the run's label in comparisons.
    <run>/provenance.json {"commit": sha | "unknown", "dirty": bool | null, "command": str, "cwd": str,
                           "time": str, "previous": [earlier starts of a resumed run]}
                          (``gspo_megatron/core/provenance.py``; runs from before it have none)
    <run>/metrics.jsonl   one JSON object per training step:
                          {"step": int, "reward/mean": float, "loss/clip_frac_token": float,
                           "loss/clip_frac_seq": float, ...any other scalar metrics}
    <run>/routing.jsonl   one JSON object per step and diagnostic kind:
                          {"step": int, "kind": "update" | "rollout_vs_train" | "minibatch",
                           "changed_frac": [L], "overlap": [L],
                           "changed_frac_overall": float (expert sets changed: any member differs),
                           "overlap_overall": float, "experts_changed_per_slot": float (1 - overlap),
                           "tokens": int,
                           "changed_any_frac": float (token-level: experts differ in >= 1 layer),
                           "expert_load": [[L x E]], "load_imbalance": [L], "load_cv": [L]}
                          (the last three are present only when the trainer measured them)

Only ``metrics.jsonl`` is required: a run without routing diagnostics has no ``routing.jsonl``, and
a run without ``config.yaml`` is labelled by its directory name.

Design decisions:
- JSON Lines, one flushed line per record: a crash loses at most the line being written. Readers
  drop an unterminated, unparsable *last* line (a partial write) but fail loudly, with the line
  number, on a bad line anywhere else (real corruption must not be skipped silently).
- A writer reopening a file that ends in a partial line first cuts that partial line off, so a
  resumed run never glues its first record onto the fragment.
- A record is appended as one ``os.write`` of the whole encoded line (no buffered writer that splits
  it); a write that fails (disk full, ``ulimit -f``, quota) cuts the file back to its length before the
  record and raises ``RunLogWriteError`` naming the file, the bytes and the fix, so the file never ends
  in a partial line while the run lives.
- Records are made JSON-safe in one place (``to_jsonable``): tensors and numpy values become
  Python numbers and nested lists, so callers may pass tensors straight from the diagnostics.
- Non-finite floats are written as JSON ``NaN``/``Infinity`` (Python's json round-trips them), not
  dropped: a NaN diagnostic is information.
- Every file the run writes itself into its directory (config, provenance, metrics and routing records,
  reports, charts, ``checkpoints/latest``, the lock's files) is opened through ``open_run_file``, which
  never follows a symbolic link at the file's name (``O_NOFOLLOW``) and writes only into a regular file
  (checkpoint shards go into a directory the save has just made; wandb and TensorBoard write their
  own, under fresh names). A link planted in a run directory (shared scratch) would otherwise turn the
  run's writes onto whatever it points at, the user's own files included (issue 63). One rule for every
  writer, appends and rewrites alike, rather than a temporary file and ``os.replace`` (which cannot
  append). A run directory holding links, or owned by another user, is refused before the run starts
  (``run/run_dir_owner.py``); this rule covers a link planted after that check.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gspo_megatron.core.config_migrations import migrate_config
from gspo_megatron.core.config_node import ConfigChoice
from gspo_megatron.core.provenance import PROVENANCE_FILE

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
ROUTING_FILE = "routing.jsonl"

# metrics.jsonl keys the report and the comparison read (the trainer may log any others beside them)
REWARD_KEY = "reward/mean"
CLIP_FRAC_TOKEN_KEY = "loss/clip_frac_token"
CLIP_FRAC_SEQ_KEY = "loss/clip_frac_seq"


class RunDirError(ValueError):
    """A run directory that cannot be used as asked: not a readable run directory (missing, not a directory,
    no metrics.jsonl, corrupt), or -- for the trainer (``run/run_dir_owner.py``) -- locked, holding
    another run, nothing to resume, a bad ``checkpoint.resume`` value."""


# open_run_file's modes: what each does to the file (O_NOFOLLOW, O_NONBLOCK and O_CLOEXEC are added to all)
_WRITE_FLAGS = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "r+": os.O_RDWR,
}


def open_run_file(path: str | os.PathLike, mode: str = "w", encoding: str | None = None) -> IO:
    """Open a run-directory file for writing (``mode``: w, a, x or r+, each with an optional b) without
    following a symbolic link at ``path``, and only if it is a regular file (``open_run_fd``)."""
    fd = open_run_fd(path, mode)
    try:
        return os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


def open_run_fd(path: str | os.PathLike, mode: str = "w") -> int:
    """``open_run_file``'s descriptor: opened without following a symbolic link at ``path``, and only if it
    is a regular file. O_NONBLOCK keeps a FIFO planted there from blocking the open (it is then refused as
    not a regular file); the descriptor returned blocks."""
    flags = _WRITE_FLAGS.get(mode.replace("b", ""))
    if flags is None:
        raise ValueError(f"open_run_file mode {mode!r} is not one of {sorted(_WRITE_FLAGS)} (with or without b)")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _link_refused(path) from None
        if error.errno == errno.ENXIO:  # a FIFO without a reader
            raise RunDirError(f"{path} is a FIFO, not a regular file: remove it, or choose another run_dir") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunDirError(f"{path} is not a regular file: remove it, or choose another run_dir")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def refuse_link(path: str | os.PathLike) -> None:
    """Raise if ``path`` is a symbolic link: for a run-directory file read before it is rewritten, so
    that nothing of a link's target is read into the run either."""
    if os.path.islink(path):
        raise _link_refused(path)


def _link_refused(path: str | os.PathLike) -> RunDirError:
    return RunDirError(
        f"{path} is a symbolic link: a run never writes through one (it could point at anyone's file, yours "
        "included). Remove the link (someone else may have planted it) or choose a run_dir of your own"
    )


def write_run_file(path: str | os.PathLike, data: str | bytes, *, new: bool = False) -> None:
    """Replace the contents of a run-directory file (``open_run_file``: never through a link); ``new``:
    the file must not exist yet (O_EXCL)."""
    binary = isinstance(data, bytes)
    mode = ("x" if new else "w") + ("b" if binary else "")
    with open_run_file(path, mode, encoding=None if binary else "utf-8") as file:
        file.write(data)


def private_directory(path: Path, key: str) -> Path:
    """``path`` (set by config ``key``) as a directory only this user can enter: created with mode 0o700,
    or, when it exists, a real directory (not a link) of this user's, its mode left as the user set it
    (a directory shared with servers run by another user on purpose). Returned resolved."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        problem = _not_own_directory(os.lstat(path))
        if problem:
            raise RunDirError(
                f"{key}={path} is {problem}: what the run writes there must stay the run's own. Remove it, or "
                f"set {key} to another path (a relative path lies under run_dir)"
            ) from None
    return path.resolve()


def _not_own_directory(entry: os.stat_result) -> str | None:
    """Why an existing entry (``os.lstat``) is not a directory of this user's, or None when it is one."""
    if stat.S_ISLNK(entry.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(entry.st_mode):
        return "not a directory"
    if entry.st_uid != os.geteuid():
        return f"owned by uid {entry.st_uid}, not by you (uid {os.geteuid()})"
    return None


def to_jsonable(value: Any) -> Any:
    """Tensors, numpy arrays/scalars, tuples and dicts -> plain JSON types (recursively)."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch here
        value = value.detach().cpu().tolist()
    elif hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"cannot write {type(value).__name__} to a run-directory JSON record: {value!r}")


def _cut_partial_last_line(path: Path) -> None:
    """If ``path`` ends without a newline (a write was interrupted), drop that partial line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1  # 0 when the whole file is one partial line
    with open_run_file(path, "r+b") as f:
        f.truncate(keep)


class RunLogWriteError(OSError):
    """A record could not be appended to a run-directory log: names the file, the bytes and the fix; the
    file was cut back to whole lines (``errno`` is the write's: ENOSPC, EFBIG, EDQUOT, ...)."""


# what frees a write that failed with this errno (any other: the OS's reason is all there is)
_WRITE_FIXES = {
    errno.ENOSPC: "free space on the device holding it",
    errno.EDQUOT: "free space within your disk quota there, or raise the quota",
    errno.EFBIG: "raise the file-size limit of the shell that starts the run (`ulimit -f unlimited`)",
}


class JsonlLog:
    """Appends one JSON object per line to a file, each as one write of the whole line, straight to the
    file (nothing buffered in this process)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_partial_last_line(self.path)
        self._fd: int | None = open_run_fd(self.path, "a")  # never through a link; held until close()

    def append(self, record: dict) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: log is closed")
        line = (json.dumps(to_jsonable(record)) + "\n").encode("utf-8")
        before = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
            while written < len(line):  # a short write: the next one says why (or finishes the line)
                written += os.write(self._fd, line[written:])
        except OSError as error:
            raise self._write_failed(error, len(line), before) from error

    def _write_failed(self, error: OSError, size: int, before: int) -> RunLogWriteError:
        """Cut the file back to ``before`` bytes (the whole lines it held) and name the failure."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, before)
            kept = f"{self.path} is kept as it was before this record ({before} bytes, whole lines)"
        except OSError as cut_error:
            kept = (
                f"cutting {self.path} back to {before} bytes failed too ({cut_error.strerror}): its last line "
                "may be partial (readers drop it, and a resumed run cuts it off)"
            )
        fix = _WRITE_FIXES.get(error.errno or 0, "fix what the error names")
        return RunLogWriteError(
            error.errno or errno.EIO,
            f"could not append a {size}-byte record to {self.path}: {error.strerror or error}; {kept}. "
            f"Fix: {fix}, then continue the run with checkpoint.resume=true",
        )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON Lines file, dropping an unterminated unparsable last line (an interrupted write)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    terminated = text.endswith("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not terminated:
                break  # partial last line of a run that is still writing (or crashed)
            raise RunDirError(f"{path}:{number}: not valid JSON ({err.msg}); the file is corrupt") from err
        if not isinstance(record, dict):
            raise RunDirError(f"{path}:{number}: expected a JSON object per line, got {type(record).__name__}")
        records.append(record)
    return records


def drop_records_from_step(path: str | os.PathLike, step: int) -> int:
    """Keep only records with ``step`` < ``step`` (resume from a checkpoint at ``step``); returns how many remain.

    Call it for metrics.jsonl *and* routing.jsonl on resume, before reopening the logs, so the files
    hold what an uninterrupted run would have written (no duplicated steps in report averages).
    """
    path = Path(path)
    refuse_link(path)
    if not path.is_file():
        return 0
    kept = [r for r in read_jsonl(path) if r.get("step", 0) < step]
    tmp = path.with_name(path.name + ".tmp")
    write_run_file(tmp, "".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one, never half
    return len(kept)


@dataclass
class RunData:
    """Everything read from one run directory."""

    path: Path
    label: str  # algorithm.name from config.yaml, else the directory name
    config: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    routing: list[dict] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)  # empty: the run predates provenance.json

    @property
    def commit(self) -> str | None:
        commit = self.provenance.get("commit")
        return None if commit is None else commit + ("+dirty" if self.provenance.get("dirty") else "")

    def metric_series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the steps that logged it."""
        pairs = [(r["step"], r[key]) for r in self.metrics if key in r and r[key] is not None and "step" in r]
        return [s for s, _ in pairs], [float(v) for _, v in pairs]

    def routing_kinds(self) -> list[str]:
        return sorted({r["kind"] for r in self.routing if "kind" in r})

    def routing_records(self, kind: str) -> list[dict]:
        """``kind``'s records over every position (not the per-turn ones of multi-turn runs), by step."""
        return sorted(
            (r for r in self.routing if r.get("kind") == kind and "turn" not in r), key=lambda r: r.get("step", 0)
        )

    def routing_turn_records(self, kind: str) -> dict[int, list[dict]]:
        """``kind``'s per-turn records (multi-turn runs: ``"turn": t``), by turn, each by step."""
        turns: dict[int, list[dict]] = {}
        for record in sorted(self.routing, key=lambda r: r.get("step", 0)):
            if record.get("kind") == kind and "turn" in record:
                turns.setdefault(int(record["turn"]), []).append(record)
        return dict(sorted(turns.items()))


def _algorithm_name(config: dict) -> str | None:
    algorithm = config.get("algorithm")
    if isinstance(algorithm, dict) and isinstance(algorithm.get("name"), str):
        return algorithm["name"]
    return None


def load_run(path: str | os.PathLike) -> RunData:
    """Read a run directory; raises RunDirError naming what is missing when ``path`` is not one."""
    path = Path(path)
    if not path.exists():
        raise RunDirError(f"run directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise RunDirError(f"{str(path)!r} is a file, not a run directory; pass the directory holding {METRICS_FILE}")
    if not (path / METRICS_FILE).is_file():
        present = sorted(p.name for p in path.iterdir())[:10]
        raise RunDirError(
            f"{str(path)!r} is not a run directory: it has no {METRICS_FILE} (found: {present or 'nothing'}). "
            f"A run directory holds {CONFIG_FILE}, {METRICS_FILE} and optionally {ROUTING_FILE}; "
            "see gspo_megatron/core/run_dir.py"
        )
    config: dict = {}
    if (path / CONFIG_FILE).is_file():
        import yaml

        try:
            loaded = yaml.safe_load((path / CONFIG_FILE).read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise RunDirError(f"{path / CONFIG_FILE}: not valid YAML: {err}") from err
        config = migrate_config(loaded)[0] if isinstance(loaded, dict) else {}  # older runs: today's keys
    routing = read_jsonl(path / ROUTING_FILE) if (path / ROUTING_FILE).is_file() else []
    provenance_path = path / PROVENANCE_FILE
    try:
        provenance = json.loads(provenance_path.read_text(encoding="utf-8")) if provenance_path.is_file() else {}
    except json.JSONDecodeError as err:
        raise RunDirError(f"{provenance_path}: not valid JSON ({err.msg})") from err
    return RunData(
        path=path,
        label=_algorithm_name(config) or path.resolve().name,
        config=config,
        metrics=read_jsonl(path / METRICS_FILE),
        routing=routing,
        provenance=provenance if isinstance(provenance, dict) else {},
    )


def finite_mean(values: Sequence[float | None]) -> float | None:
    """Mean of the finite values, None when there are none (keeps NaN steps from poisoning summaries)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(finite) / len(finite) if finite else None


# The windows a run is summarised over, by name: the run summary printed at the end of a job, the routing
# report and the comparison's verdicts all read these, so one label always means one number.
FIRST_FIFTH, LAST_FIFTH, WHOLE_RUN = "first 20%", "last 20%", "whole run"
WINDOWS = (FIRST_FIFTH, LAST_FIFTH, WHOLE_RUN)


def window_mean(values: Sequence[float | None], window: str) -> float | None:
    """The mean of the finite ``values`` (in step order) over ``window``: the first or last fifth of them (at
    least one) or all of them; None when none is finite."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not finite:
        return None
    if window not in WINDOWS:
        raise ValueError(f"unknown summary window {window!r}; valid windows: {', '.join(WINDOWS)}")
    part = max(1, len(finite) // 5)
    chosen = finite[:part] if window == FIRST_FIFTH else finite[-part:] if window == LAST_FIFTH else finite
    return sum(chosen) / len(chosen)


class ResumeMode(ConfigChoice):
    """``checkpoint.resume``. The field stays a string in the schema: Hydra hands ``true``/``false``
    over as booleans, which an enum node would refuse; ``resume_mode`` reads it as one of these."""

    false = "false"  # a fresh run
    true = "true"  # a checkpoint must exist
    auto = "auto"  # resume if there is one


RESUME_MODES = tuple(ResumeMode)


def resume_mode(value: object) -> ResumeMode:
    """``checkpoint.resume`` as one of false | true | auto (Hydra hands booleans over as 'True')."""
    mode = str(value).strip().lower()
    if mode not in RESUME_MODES:
        raise RunDirError(f"checkpoint.resume={value!r} is not one of {[str(m) for m in RESUME_MODES]}")
    return ResumeMode(mode)


def new_run_id() -> str:
    """A run's id: its checkpoints carry it, and pruning removes only its own (``policy/checkpoint/store.py``)."""
    return uuid.uuid4().hex
