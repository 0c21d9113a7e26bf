"""The ``python`` tool: runs the model's code in a fresh, limited interpreter and returns what it printed.

Design decisions:
- Each call is a new process, ``[sys.executable, "-I", "-S", "-c", <preamble + code>]``: isolated mode (no
  PYTHON* variables, no user site, the script's folder not on sys.path), no site-packages (the standard
  library only), the working directory a scratch directory that persists across the calls of one
  ``PythonSandbox`` (one per trajectory: later turns see earlier turns' files), an environment of PATH,
  HOME and TMPDIR (both the scratch directory, so ``tempfile`` works inside it), stdin /dev/null (reads
  EOF at once).
- Limits, set by ``preexec_fn`` in the child before exec: CPU seconds (``RLIMIT_CPU``: SIGXCPU, SIGKILL a
  second later), address space (``RLIMIT_AS``: allocations fail with MemoryError), file size
  (``RLIMIT_FSIZE``: Python ignores SIGXFSZ, so a write past it raises OSError), no core files. A limit
  is never raised above the hard limit this process already has. The wall-clock limit and the output cap
  are the parent's: it reads stdout and stderr together, at most ``max_output_bytes`` in all, and kills
  the process group (``start_new_session``) when either runs out. ``preexec_fn`` is documented as unsafe
  when the parent has threads (the runner calls from one): this one only calls ``setrlimit``, which needs
  none of the locks another thread could have held at the fork.
- The wall limit is the constructor's ``wall_timeout_s``; the attribute ``timeout_s`` is the Tool
  protocol's, the runner's bound, set to the wall limit plus ``RUNNER_MARGIN_S`` so the sandbox's own
  kill, which also ends the process, comes first.
- ``RLIMIT_NPROC`` = 0 would stop forks only for an unprivileged user (root ignores it) and would stop
  threads too; instead the preamble installs an audit hook (PEP 578) that refuses process creation,
  sockets and name lookups, ctypes, changing rlimits, signalling other processes, and writes outside
  the scratch directory (opens for write/append/create, ``os.open`` with write flags, remove, rename,
  link, mkdir, rmdir, chmod, chown, utime, truncate, xattrs, ``shutil.rmtree``; symlinks not at all).
  ``os.open``'s event carries no ``dir_fd``, so it may not open a directory outside (which could then be
  a ``dir_fd`` to write through) nor follow a relative path climbing with "..".
  Reads stay allowed anywhere, so the interpreter can import the standard library. Before refusing, the
  hook writes ``SANDBOX-REFUSED: <event>`` to stderr; the parent reads that marker, so a refusal is
  reported as ``refused`` even when the code catches the PermissionError.
- ``_posixsubprocess.fork_exec`` starts processes without any audit event, so the preamble imports
  ``subprocess`` (which keeps working as a module; ``Popen`` is refused by its event), deletes
  ``fork_exec``, and the hook refuses any later import of ``_posixsubprocess`` (re-creating it from its
  spec raises the import event too).
- The hook resolves paths itself (symlinks followed, relative paths against the current directory or
  the ``dir_fd``), from primitives bound as default arguments when it is defined, so user code that
  monkeypatches ``os``/``os.path``/builtins does not change what the hook sees; replacing the hook's
  ``__code__``/``__defaults__`` is refused.
- Audit hooks are a tripwire, not a security boundary (PEP 578 says so): code determined to escape can
  find ways the hook does not see (bugs in C extensions, write access through descriptors it already
  holds); reads are not confined at all; and nothing bounds the scratch directory's total size, only each
  file's. Run the sandbox under an unprivileged user or in a container when the model is not trusted.
- Outcome, in this order: killed at the wall limit -> ``timeout``; output over the cap -> ``too_large``;
  the marker on stderr -> ``refused``; killed by a signal (SIGXCPU, SIGKILL, SIGSEGV) or ending in
  MemoryError -> ``crashed``; another nonzero exit -> ``raised``, with stdout and the last lines of
  stderr (the traceback) as content; else stdout (stderr, warnings, dropped).
"""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gspo_megatron.rollout.agents.tools.base import ToolResult, ToolSpec

MiB = 1 << 20
RUNNER_MARGIN_S = 2.0
REFUSED_MARKER = "SANDBOX-REFUSED: "
STDERR_TAIL_LINES = 20
STDERR_TAIL_CHARS = 4000
# Linux refuses one argv string over 32 pages (MAX_ARG_STRLEN, 128 KiB); the preamble + code is one
MAX_PROGRAM_BYTES = 120_000
_READ_CHUNK = 65536
_EXIT_POLL_S = 0.01

# Run in the child before the code. Placeholders (``sandbox_program``): __SCRATCH__ (the scratch directory's
# real path), __WATCHED__ and __REFUSED__ (the event tuples below), __MARKER__ and __CODE__ (the code, as a
# string literal). Every name the hook and its helper use is a default argument, bound once here, so later
# assignments to os, os.path or builtins do not reach them.
_PREAMBLE = r'''
import sys

sys.dont_write_bytecode = True  # an import must not try to write __pycache__ outside the scratch directory
import os, subprocess, _posixsubprocess
del _posixsubprocess.fork_exec, subprocess._fork_exec  # starts processes without an audit event


def _sandbox_inside(path, dir_fd, scratch=__SCRATCH__, lstat=os.lstat, readlink=os.readlink, getcwd=os.getcwd,
                    fspath=os.fspath, fsdecode=os.fsdecode, isinstance=isinstance, int=int, str=str, OSError=OSError):
    """Whether ``path`` (relative to ``dir_fd`` or the current directory) lies in the scratch directory."""
    if isinstance(path, int):  # a descriptor: the file it is open on
        path = readlink("/proc/self/fd/" + str(path))
        if not path.startswith("/"):
            return True  # a pipe or a socket, no file
    path = fsdecode(fspath(path))
    if not path.startswith("/"):
        base = getcwd() if dir_fd is None or dir_fd < 0 else readlink("/proc/self/fd/" + str(dir_fd))
        path = base + "/" + path
    pending, parts, hops = path.split("/")[::-1], [], 0
    while pending:  # os.path.realpath, from the primitives bound above
        part = pending.pop()
        if part == "" or part == ".":
            continue
        if part == "..":
            parts = parts[:-1]
            continue
        here = "/" + "/".join(parts + [part])
        try:
            is_link = lstat(here).st_mode & 0o170000 == 0o120000
        except OSError:
            is_link = False  # not there (yet): the rest is taken as written
        if not is_link:
            parts = parts + [part]
            continue
        hops += 1
        if hops > 40:
            raise OSError("sandbox: too many levels of symbolic links in " + path)
        target = readlink(here)
        if target.startswith("/"):
            parts = []
        pending.extend(target.split("/")[::-1])
    real = "/" + "/".join(parts)
    return real == scratch or real.startswith(scratch.rstrip("/") + "/")


def _sandbox_hook(event, args, inside=_sandbox_inside, guarded=(),
                  watched=frozenset(__WATCHED__), refused=frozenset(__REFUSED__),
                  refused_imports=frozenset({"_posixsubprocess", "_ctypes"}),
                  with_dir_fd=frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime",
                                         "shutil.rmtree"}),
                  write_flags=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                  write=os.write, getpid=os.getpid, stat=os.stat, fspath=os.fspath, fsdecode=os.fsdecode,
                  isinstance=isinstance, int=int, str=str, OSError=OSError, PermissionError=PermissionError):
    if event not in watched and not event.startswith("ctypes."):
        return
    what = event
    if event in refused or event.startswith("ctypes."):
        allowed = False
    elif event == "import":
        allowed = args[0] not in refused_imports
        what = "import " + str(args[0])
    elif event == "os.kill" or event == "os.killpg":
        allowed = args[0] == getpid()  # itself only (the session leader: its group id is its pid)
    elif event == "object.__setattr__" or event == "object.__delattr__":  # the hook's __code__, __defaults__
        allowed = args[0] is not guarded[0] and args[0] is not guarded[1]
    elif event == "open":  # open() (mode a str) and os.open (mode None; its event carries no dir_fd)
        path, mode, flags = args
        name = "" if isinstance(path, int) else fsdecode(fspath(path))
        writes = flags & write_flags or (mode is not None and ("w" in mode or "a" in mode or "x" in mode
                                                               or "+" in mode))
        if isinstance(path, int):
            allowed = True  # an open descriptor: checked when it was opened
        elif mode is None and not name.startswith("/") and ".." in name.split("/"):
            allowed = False  # climbing out of a dir_fd the hook cannot see
        elif writes:
            allowed = inside(path, -1)
        elif mode is None:  # os.open, read-only: a directory outside could become a dir_fd to write through
            try:
                is_dir = stat(path).st_mode & 0o170000 == 0o040000
            except OSError:
                is_dir = False
            allowed = not is_dir or inside(path, -1)
        else:
            allowed = True  # reading a file
    elif event == "os.rename" or event == "os.link":
        allowed = inside(args[0], args[2]) and inside(args[1], args[3])
    else:  # a path first, and for some calls a dir_fd last
        allowed = inside(args[0], args[-1] if event in with_dir_fd else -1)
    if not allowed:
        write(2, ("\n" + __MARKER__ + what + "\n").encode())
        raise PermissionError("sandbox: " + what + " is not allowed")


_sandbox_hook.__defaults__ = (_sandbox_inside, (_sandbox_hook, _sandbox_inside)) + _sandbox_hook.__defaults__[2:]
sys.addaudithook(_sandbox_hook)
del _sandbox_hook, _sandbox_inside, os, sys, subprocess, _posixsubprocess
exec(compile(__CODE__, "<code>", "exec"))
'''

# events refused whatever their arguments
_REFUSED_EVENTS = (
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "subprocess.Popen",
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
    "os.symlink",
    "resource.setrlimit",
    "resource.prlimit",
)
# events the hook looks at (besides "ctypes.*"); the rest pass at once
_WATCHED_EVENTS = (
    *_REFUSED_EVENTS,
    "import",
    "open",
    "object.__setattr__",
    "object.__delattr__",
    "os.kill",
    "os.killpg",
    "os.remove",
    "os.rmdir",
    "os.rename",
    "os.link",
    "os.mkdir",
    "os.chmod",
    "os.chown",
    "os.utime",
    "os.truncate",
    "os.setxattr",
    "os.removexattr",
    "os.chflags",
    "shutil.rmtree",
)


def sandbox_program(code: str, scratch: str) -> str:
    """The ``-c`` program: the preamble with the scratch directory and the code filled in."""
    return (
        _PREAMBLE.replace("__SCRATCH__", repr(scratch))
        .replace("__WATCHED__", repr(_WATCHED_EVENTS))
        .replace("__REFUSED__", repr(_REFUSED_EVENTS))
        # as two literals: no line of the program holds the marker, should a traceback ever show one
        .replace("__MARKER__", f"{REFUSED_MARKER[:7]!r} {REFUSED_MARKER[7:]!r}")
        .replace("__CODE__", repr(code))  # last: the code may contain the other placeholders
    )


def _limits(cpu_s: int, memory_bytes: int, file_bytes: int) -> list[tuple[int, tuple[int, int]]]:
    """(resource, (soft, hard)) to set in the child, none above the hard limit this process has."""
    wanted = [
        (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        (resource.RLIMIT_AS, (memory_bytes, memory_bytes)),
        (resource.RLIMIT_FSIZE, (file_bytes, file_bytes)),
        (resource.RLIMIT_CORE, (0, 0)),  # no core file in the scratch directory
    ]
    limits = []
    for which, (soft, hard) in wanted:
        current = resource.getrlimit(which)[1]
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        limits.append((which, (soft, hard)))
    return limits


def _exited(pid: int) -> bool:
    """Whether the process has ended, without reaping it (its pid, the group's id, stays taken until then)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def _joined(stdout: str, stderr: str) -> str:
    return stdout + "\n" + stderr if stdout and stderr and not stdout.endswith("\n") else stdout + stderr


def _tail(text: str) -> str:
    return "\n".join(text.rstrip("\n").split("\n")[-STDERR_TAIL_LINES:])[-STDERR_TAIL_CHARS:]


class PythonSandbox:
    """``python(code)``: runs Python code in a fresh limited process; answers with what it printed."""

    def __init__(
        self,
        scratch_dir: str | os.PathLike[str],
        wall_timeout_s: float = 10.0,
        cpu_s: int = 5,
        memory_bytes: int = 512 * MiB,
        file_bytes: int = 1 * MiB,
        max_output_bytes: int = 65536,
    ):
        """``scratch_dir``: the code's working directory (created if missing), the one place it may write."""
        if wall_timeout_s <= 0 or cpu_s <= 0 or memory_bytes <= 0 or file_bytes < 0 or max_output_bytes <= 0:
            raise ValueError("the sandbox's limits must be positive")
        self.scratch = Path(scratch_dir)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.scratch = self.scratch.resolve()  # the hook compares real paths
        self.wall_timeout_s = wall_timeout_s
        self.timeout_s = wall_timeout_s + RUNNER_MARGIN_S  # the runner's bound: the sandbox's own kill comes first
        self.cpu_s, self.memory_bytes, self.max_output_bytes = cpu_s, memory_bytes, max_output_bytes
        self._limits = _limits(cpu_s, memory_bytes, file_bytes)
        self.spec = ToolSpec(
            name="python",
            description=(
                "Run Python 3 code (standard library only) in a fresh interpreter and return what it prints. "
                f"No network, no subprocesses; files only in the working directory; at most {wall_timeout_s:g} s, "
                f"{memory_bytes // MiB} MiB and {max_output_bytes} bytes of output. Use print() to see results."
            ),
            parameters={
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the Python program to run"}},
                "required": ["code"],
                "additionalProperties": False,
            },
        )

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        program = sandbox_program(arguments["code"], str(self.scratch))
        if len(program.encode("utf-8", errors="surrogateescape")) > MAX_PROGRAM_BYTES:
            return ToolResult(
                f"python: the code is too long (the limit is about {MAX_PROGRAM_BYTES} bytes)", "bad_arguments"
            )
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", program],
            cwd=self.scratch,
            env={"PATH": os.environ.get("PATH", os.defpath), "HOME": str(self.scratch), "TMPDIR": str(self.scratch)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, killed whole
            preexec_fn=self._set_limits(),
        )
        try:
            stdout, stderr, stopped = self._collect(process)
        finally:
            _stop(process)
        return self._outcome(process.returncode, stdout, stderr, stopped)

    def _set_limits(self) -> Callable[[], None]:
        limits = self._limits

        def set_limits() -> None:  # runs in the child between fork and exec: only setrlimit calls
            for which, values in limits:
                resource.setrlimit(which, values)

        return set_limits

    def _collect(self, process: subprocess.Popen[bytes]) -> tuple[str, str, str | None]:
        """stdout, stderr and why the process was stopped: "timeout", "too_large" or None (it ended)."""
        deadline = time.monotonic() + self.wall_timeout_s
        pipes: list[IO[bytes]] = [process.stdout, process.stderr]  # type: ignore[list-item]  # both PIPE
        buffers = {pipe.fileno(): bytearray() for pipe in pipes}
        total, stopped = 0, None
        with selectors.DefaultSelector() as selector:
            for fd in buffers:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map() and stopped is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    stopped = "timeout"
                    break
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, min(_READ_CHUNK, self.max_output_bytes + 1 - total))
                    if not chunk:  # end of file: the process closed it (or ended)
                        selector.unregister(key.fd)
                        continue
                    buffers[key.fd] += chunk
                    total += len(chunk)
                    if total > self.max_output_bytes:
                        stopped = "too_large"
                        break
        # both pipes closed: the process has ended, or closed them and runs on until the deadline
        while stopped is None and not _exited(process.pid):
            if time.monotonic() >= deadline:
                stopped = "timeout"
            time.sleep(_EXIT_POLL_S)
        stdout, stderr = (buffers[pipe.fileno()].decode("utf-8", errors="replace") for pipe in pipes)
        return stdout, stderr, stopped

    def _outcome(self, returncode: int, stdout: str, stderr: str, stopped: str | None) -> ToolResult:
        if stopped == "timeout":
            return ToolResult(
                f"python: the code ran past its wall-clock limit of {self.wall_timeout_s:g} s and was stopped",
                error="timeout",
            )
        if stopped == "too_large":
            return ToolResult(
                f"python: the output passed {self.max_output_bytes} bytes and the code was stopped", error="too_large"
            )
        shown = _joined(stdout, _tail(stderr))
        if REFUSED_MARKER in stderr:
            return ToolResult(shown, error="refused")
        if returncode < 0:
            name = _signal_name(-returncode)
            why = {
                "SIGXCPU": f" (the CPU-time limit of {self.cpu_s} s)",
                "SIGKILL": " (the CPU-time hard limit, or out of memory)",
            }.get(name, "")
            return ToolResult(f"{stdout}python: the process was killed by {name}{why}", error="crashed")
        if returncode != 0 and _tail(stderr).rsplit("\n", 1)[-1].startswith("MemoryError"):
            return ToolResult(
                f"{shown}\npython: out of memory (the limit is {self.memory_bytes // MiB} MiB)", "crashed"
            )
        if returncode != 0:
            return ToolResult(shown or f"python: the code exited with status {returncode}", error="raised")
        return ToolResult(stdout)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Kill the process group, then reap the leader and close the pipes. Until it is reaped the leader's pid
    -- the group's id -- cannot be reused, so the kill reaches only what the code started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for pipe in (process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()
