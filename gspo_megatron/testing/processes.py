"""Find a run's processes and their listening sockets through /proc (Linux), for the fault tests.

A run started with ``marked_env()`` carries a unique variable that every process it starts inherits
(ranks, reward workers, checkpoint writers, resource trackers), so its processes are found even
after their parent died and they were re-parented: ``run_processes(marker)``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from gspo_megatron.run.reaper import processes_with_env

MARKER_VARIABLE = "GSPO_TEST_RUN_MARKER"


def marked_env(base: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """(environment for a child run, its marker)."""
    marker = uuid.uuid4().hex
    env = dict(os.environ if base is None else base)
    env[MARKER_VARIABLE] = marker
    return env, marker


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def run_processes(marker: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``marker``."""
    return sorted(pid for pid in processes_with_env(MARKER_VARIABLE, marker) if _alive(pid))


def kill_run_processes(marker: str) -> list[int]:
    """SIGKILL every live process carrying ``marker``; returns the pids it found."""
    found = run_processes(marker)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)
    return found


def _parent_and_command(pid: int) -> tuple[int, str] | None:
    """(parent pid, command line) of ``pid``, or None once it is gone."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1]), cmdline


def children(pid: int) -> dict[int, str]:
    """pid -> command line of the live children of ``pid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        known = _parent_and_command(int(entry.name)) if entry.name.isdigit() else None
        if known is not None and known[0] == pid:
            found[int(entry.name)] = known[1]
    return found


def describe(pids: list[int]) -> str:
    """``pid (ppid) command line`` per process, for failure messages."""
    lines = []
    for pid in pids:
        known = _parent_and_command(pid)
        if known is not None:
            lines.append(f"{pid} (parent {known[0]}) {known[1][:160]}")
    return "\n".join(lines)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    except OSError:
        pass
    return inodes


def _address(hex_address: str) -> str:
    if len(hex_address) == 8:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_address, 16)))
    words = [struct.pack("<I", int(hex_address[i : i + 8], 16)) for i in range(0, 32, 8)]
    return socket.inet_ntop(socket.AF_INET6, b"".join(words))


def listening_tcp() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this network namespace: inode -> (address, port)."""
    sockets = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            sockets[int(fields[9])] = (_address(address), int(port, 16))
    return sockets


def listeners_of(pids: list[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes hold."""
    listening = listening_tcp()
    return {(pid, *listening[inode]) for pid in pids for inode in _socket_inodes(pid) if inode in listening}


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or address.startswith("::ffff:127.")


def eventually(condition: Callable[[], bool], timeout: float, poll: float = 0.05) -> bool:
    """Poll ``condition`` until true (True) or ``timeout`` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


def wait_until(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.05) -> None:
    """Poll ``condition`` until true; AssertionError naming ``what`` after ``timeout`` seconds."""
    assert eventually(condition, timeout, poll), f"timed out after {timeout:.0f} s waiting for {what}"
