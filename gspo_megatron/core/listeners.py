"""Listening sockets on exactly the address they were given, and the TCPStore servers the project runs on them.

Design decisions:
- torch's TCPStore server (``is_master=True``) listens on every interface whatever host it is given
  (torch 2.13, libuv backend: ``::``, dual-stack), so a store meant for 127.0.0.1 could be joined from
  any machine that reaches this one (issue 63: another user's process joined the weight-sync group as
  rank 1 and received the weights). TCPStore's supported way to choose the address is
  ``master_listen_fd``: a socket already bound and listening, which the store takes over and closes.
  Every store the project serves is made by ``serve_store`` on a socket from ``listen_on``.
- Port 0 asks the kernel for a free port at bind time and reads it back from the socket: no window
  between choosing a port and listening on it, in which another process could take it.
- Binding is not authentication: whoever reaches the address can read and write the store
  (docs/cluster.md, "What cannot authenticate").
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

LISTEN_BACKLOG = 1024  # every rank of a large job may connect at once


def listen_on(address: str, port: int) -> socket.socket:
    """A TCP socket bound to ``address:port`` only (port 0: a free one) and listening.

    OSError names the address when it is not one of this machine's, or the port is taken."""
    try:
        family, kind, protocol, _, socket_address = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise OSError(error.errno, f"cannot resolve {address!r} to listen on ({error.strerror})") from None
    sock = socket.socket(family, kind, protocol)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(socket_address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as error:
        sock.close()
        message = f"cannot listen on {address}:{port} ({error.strerror}); is {address} an address of this machine?"
        raise OSError(error.errno, message) from None
    return sock


def serve_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server that listens on ``address:port`` only (port 0: a free one, read as ``.port``).

    It does not wait for its clients (they wait on keys); ``timeout_s`` bounds every get/wait on it."""
    import torch.distributed as dist  # here, not at import: the launcher binds its socket before torch loads

    listener = listen_on(address, port)
    return dist.TCPStore(
        address,
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),  # the store owns (and closes) the socket from here
        use_libuv=True,
    )
