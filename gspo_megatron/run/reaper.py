"""No helper outlives its trainer (issue 34, D4): a small watchdog process per rank.

After a SIGKILL of the trainer, what it started stayed alive with parent 1: megatron's checkpoint
writer manager (a ``multiprocessing`` manager, spawned then, forked now: ``checkpoint.forked_write_results_queue``)
and a shard writer blocked on its queue,
the resource tracker and the reward fork server (kept alive by the fds those orphans inherited).
Most of them are started by megatron or ``multiprocessing``, with no hook to run
``PR_SET_PDEATHSIG`` in them, and a killed process runs no cleanup of its own.

Design:
- ``start_reaper()`` tags the trainer's environment with a fresh id (``process_tags.PROCESS_TAG``),
  which every process it starts inherits (spawned, forked, forkserver children, launched servers
  alike), and starts ``python -m gspo_megatron.run.reaper PID TAG`` without the tag, in its own
  session (a terminal's Ctrl-C does not reach it), dying with the trainer's parent process tree only
  through the trainer's own death.
- What is the trainer's own: a tagged process still in the trainer's session (reward workers,
  megatron's checkpoint writers, multiprocessing's helpers), or one carrying ``HELPER_TAG`` with the
  trainer's id (helpers the trainer starts in a session of their own on purpose: SGLang servers, and
  their children). A tagged process that left the session (``setsid``: a service a reward function
  started and detached, another run launched from inside this one) is not the trainer's and is never
  signalled, whether the trainer ended normally or was SIGKILLed.
- ``/proc/PID/environ`` shows the environment a process was exec'd with, so a child forked without
  exec (megatron's shard writers) does not show the tag: those get ``PR_SET_PDEATHSIG`` (SIGKILL)
  from an ``os.register_at_fork`` hook instead, which the kernel fires when the forking thread ends
  (the trainer forks only from its main thread: checkpoint writes; the reward pool uses forkserver).
- The reaper waits on a pidfd of the trainer (no polling). When the trainer is gone, however it
  went, its own processes get ``GRACE_S`` to end by themselves (multiprocessing's resource tracker
  ends when the trainer's end closes its pipe: a normal run leaves nothing to stop); whatever is left
  is SIGKILLed, repeatedly until none is left (a dying process may still fork), and named.
- Torch-free and small: it costs a bare interpreter per rank.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from gspo_megatron.core.process_tags import HELPER_TAG, PROCESS_TAG

ROUNDS = 20  # scans for late forks; each round kills what the previous one missed
GRACE_S = 2.0  # how long the trainer's own processes may take to end by themselves once it has ended
PR_SET_PDEATHSIG = 1
_hooked_pids: set[int] = set()
_forking_pid = 0


def _remember_forking_process() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_parent_after_fork() -> None:
    """In a forked child: SIGKILL when the forking thread ends (cleared by fork, so set it here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _forking_pid:  # the parent died before prctl: the signal will never come
        os._exit(1)


def start_reaper() -> subprocess.Popen:
    """Tag this process's environment and start its reaper (a second call in one process reuses both)."""
    tag = os.environ.get(PROCESS_TAG)
    if tag is not None and tag.startswith(f"{os.getpid()}-") and _REAPERS and _REAPERS[-1].poll() is None:
        return _REAPERS[-1]
    if tag is None or not tag.startswith(f"{os.getpid()}-"):  # a tag inherited from a parent is not ours
        tag = f"{os.getpid()}-{uuid.uuid4().hex}"
        os.environ[PROCESS_TAG] = tag
    if os.getpid() not in _hooked_pids:  # register_at_fork hooks cannot be removed: once per process
        os.register_at_fork(before=_remember_forking_process, after_in_child=_die_with_parent_after_fork)
        _hooked_pids.add(os.getpid())
    env = {k: v for k, v in os.environ.items() if k != PROCESS_TAG}
    command = [sys.executable, "-m", "gspo_megatron.run.reaper", str(os.getpid()), tag, str(os.getsid(0))]
    return subprocess.Popen(command, env=env, start_new_session=True, stdin=subprocess.DEVNULL)


_REAPERS: list[subprocess.Popen] = []  # held for the process's lifetime: they outlive every run() call


def keep_reaper(reaper: subprocess.Popen) -> None:
    """Keep the handle (a collected ``Popen`` of a running child warns), one per process."""
    if reaper not in _REAPERS:
        _REAPERS.append(reaper)


def tagged_processes(tag: str) -> list[int]:
    return processes_with_env(PROCESS_TAG, tag)


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone
        return None


def own_processes(tag: str, session: int | None) -> list[int]:
    """The trainer's own processes: tagged and in its session, or marked as its helpers."""
    helpers = set(processes_with_env(HELPER_TAG, tag))
    found = []
    for pid in tagged_processes(tag):
        if pid == os.getpid():
            continue
        if pid in helpers or (session is not None and session_of(pid) == session):
            found.append(pid)
    return found


def processes_with_env(variable: str, value: str) -> list[int]:
    """Processes whose environment holds ``variable=value`` (inherited by everything they start)."""
    needle = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def stop_own_processes(tag: str, session: int | None, grace_s: float = GRACE_S) -> int:
    """Give the trainer's own processes ``grace_s`` to end, then SIGKILL them until none is left;
    returns how many were killed."""
    deadline = time.monotonic() + grace_s
    while own_processes(tag, session) and time.monotonic() < deadline:
        time.sleep(0.02)
    killed: set[int] = set()
    for _ in range(ROUNDS):
        alive = own_processes(tag, session)
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
    return len(killed)


def main(argv: list[str]) -> int:
    trainer_pid, tag = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the trainer's end ends the reaper
    session = int(argv[2]) if len(argv) > 2 else session_of(trainer_pid)
    try:
        pidfd = os.pidfd_open(trainer_pid)
    except ProcessLookupError:
        pidfd = None  # already gone: clean up at once
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable when the trainer has exited
        os.close(pidfd)
    killed = stop_own_processes(tag, session)
    if killed:
        print(
            f"[gspo] reaper: the trainer (pid {trainer_pid}) ended; stopped {killed} process(es) it left",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
