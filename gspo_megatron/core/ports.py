"""A TCP port that is free now, for a process that binds it moments later (a rendezvous, a server we launch).

Design decisions:
- Chosen outside the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by
  default). Binding port 0 hands out a port of that range, the same range every outgoing connection on the
  machine draws its local port from: between our close and the later bind, another process's connect() could
  take it (CI, two pytest workers: a gloo rendezvous failed with EADDRINUSE on the port just chosen). Below the
  range only another explicit bind can take it, and a random draw makes two callers' picks collide rarely.
- Each draw is checked by binding it; after ``DRAWS`` taken ports the kernel's own choice is returned.
- Where the listener is ours and in this process, bind port 0 and read it back instead (``core/listeners.py``):
  no window at all.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above the well-known and most registered service ports
DRAWS = 64
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default, where the file cannot be read


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (inclusive)."""
    try:
        low, high = (int(value) for value in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free right now, drawn below the ephemeral range (module docstring)."""
    low, _ = ephemeral_range()
    if low - LOWEST > DRAWS:
        for _ in range(DRAWS):
            port = random.randint(LOWEST, low - 1)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
