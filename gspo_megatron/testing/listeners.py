"""What a listener of this process is bound to, and whether another address of the machine reaches it.

For the tests that every listener binds the address it was given (issue 63): the bound address is read
from the kernel (psutil), and reachability is tried from a non-loopback IPv4 address of this machine
(a connection another host would make; None where the machine has none).
"""

from __future__ import annotations

import socket

import psutil

CONNECT_TIMEOUT_S = 5.0


def listening_addresses(port: int) -> set[str]:
    """The addresses this process's listening TCP sockets on ``port`` are bound to (``::``: every one)."""
    return {
        connection.laddr.ip
        for connection in psutil.Process().net_connections(kind="tcp")
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port
    }


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine outside 127/8, or None."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


def reachable(address: str, port: int) -> bool:
    """Whether a TCP connection to ``address:port`` is accepted (refused or unroutable: False)."""
    try:
        with socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False
