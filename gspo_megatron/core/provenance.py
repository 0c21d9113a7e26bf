"""Where a result came from: the code's commit and the exact command, recorded with every run and report.

A report that cannot be traced to its code cannot be trusted (issue 31: a stored report sat 126
commits before the code beside it). Each run directory gets ``provenance.json`` when it starts
(``run/run_log.py``); the study report records its own and every run's (``tools/compare_runs.py``),
and warns when its runs come from different commits.

Design decisions:
- The commit is read with ``git`` from the package's own checkout (not the current directory), and
  a checkout with uncommitted changes says so (``dirty``): such a run is not reproducible from the
  commit alone. Outside a git checkout the commit is ``"unknown"`` -- recorded, never guessed.
- The command is the process's own argv, re-spelled as ``python -m <module>`` when it ran as a
  module, so it can be pasted back. Under a Hydra multirun every job records the sweep command;
  the job's own overrides are its composed ``config.yaml`` beside it.
- A result depends on more than the commit: torch's CPU kernels reduce in an order set by the thread
  count (the same warm start at 1 and at 2 threads gives different weights), and a run starts from
  a checkpoint that another command wrote. Runs record their thread count (``cpu_threads``) and,
  when their ``model.hf_checkpoint`` was written by ``tools/sft_warmstart.py``, that checkpoint's
  ``warm_start.json`` (its commit, command, thread count and weights' sha256); reports warn when
  these differ between runs.
- Torch-free and dependency-free: tools and report writers import it without building a model.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

PROVENANCE_FILE = "provenance.json"
WARM_START_FILE = "warm_start.json"  # in a checkpoint directory tools/sft_warmstart.py wrote
UNKNOWN = "unknown"
_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(_ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_version() -> dict:
    """{"commit": sha or "unknown", "dirty": uncommitted changes to tracked files (None: unknown)}."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": UNKNOWN, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def command_line(argv: list[str] | None = None) -> str:
    """The process's command as it can be typed again (``python -m pkg.mod`` for a module run)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    script = Path(argv[0]).resolve()
    if script.suffix == ".py" and script.is_relative_to(_ROOT / "gspo_megatron"):
        module = ".".join(script.relative_to(_ROOT).with_suffix("").parts)
        return shlex.join(["python", "-m", module.removesuffix(".__main__"), *argv[1:]])
    return shlex.join(["python", *argv])


def provenance(**extra) -> dict:
    """This process's commit, command, working directory and start time, plus ``extra`` (e.g. seed)."""
    return {
        **code_version(),
        "command": command_line(),
        "cwd": str(Path.cwd()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


def same_clean_code(record: dict, version: dict | None = None) -> bool:
    """Whether a recorded result stands for this checkout: the same commit, neither with uncommitted
    changes (a dirty result, or a dirty checkout, cannot be told apart from other code)."""
    version = code_version() if version is None else version
    return (
        version["dirty"] is False
        and record.get("dirty") is False
        and record.get("commit") == version["commit"] != UNKNOWN
    )


def weights_sha256(checkpoint: str | Path) -> str:
    """sha256 over a checkpoint directory's ``*.safetensors`` files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def warm_start_record(checkpoint: str | Path | None) -> dict | None:
    """The ``warm_start.json`` that ``tools/sft_warmstart.py`` wrote beside a checkpoint, if any."""
    if checkpoint is None:
        return None
    path = Path(checkpoint) / WARM_START_FILE
    return json.loads(path.read_text()) if path.is_file() else None
