"""A single-process run opens no TCP port on a non-loopback address (the TCPStore used to listen on all)."""

from __future__ import annotations

import os
from pathlib import Path

from gspo_megatron.testing.distributed import run_distributed

LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def _listening_addresses() -> list[str]:
    """Local addresses (hex, as /proc/net shows them) of this process's listening TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].split(":")[0])
    return found


def _init_and_list(ctx):
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    apply_cpu_bridges()
    mesh = initialize_parallel(ParallelLayout(world_size=1))
    try:
        return _listening_addresses()
    finally:
        mesh.destroy()


def test_single_process_listens_on_loopback_only():
    (addresses,) = run_distributed(_init_and_list, 1)
    exposed = [a for a in addresses if a not in LOOPBACK]
    assert not exposed, f"listening on non-loopback addresses {exposed} (hex, /proc/net/tcp[6] format)"
