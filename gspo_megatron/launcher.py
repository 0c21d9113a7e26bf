"""Start the trainer's ranks on this node: ``python -m gspo_megatron.launcher --nproc-per-node N [overrides]``
(``--script tools/convert_checkpoint.py ARGS`` runs that script on every rank instead).

What torchrun did for us, without what it did wrong (issue 34, D2/D4/D7/D16):

- **One store, on the address it is told.** torchrun's rendezvous and worker stores (TCPStore
  servers, unauthenticated) listen on every interface. Here the one store every rank meets at is
  served from this process on a socket bound first to ``--master-addr`` (127.0.0.1 for one node,
  the node-0 address the other nodes dial for several; ``core/listeners.py``) and handed to
  ``TCPStore`` as ``master_listen_fd``; the ranks attach to it as clients, as they do to torchrun's
  agent store (``TORCHELASTIC_USE_AGENT_STORE``). Gloo's own sockets use ``GLOO_SOCKET_IFNAME`` (``lo`` for one
  node unless set).
- **Signals reach the ranks once, from here.** The ranks run in their own session, so a terminal's
  Ctrl-C (SIGINT to the foreground group) reaches only the launcher, never a rank's helper
  processes (a checkpoint writer killed by KeyboardInterrupt lost the save). The launcher forwards
  each SIGINT/SIGTERM to every rank; the ranks finish the step, save and stop
  (``run/signals.py``), and the launcher exits 128 + signal (130, 143), as docs/reliability.md says.
- **No rank outlives the launcher or its job.** Ranks get ``PR_SET_PDEATHSIG`` (SIGKILL when the
  launcher dies, even by SIGKILL); when one rank fails the others get SIGTERM, then SIGKILL after
  ``STOP_GRACE_S``; the exit status is the first failure's (128 + signal for a rank killed by one).
- **Loud when exposed.** A single-node job whose ``--master-addr`` is not a loopback address (e.g.
  ``0.0.0.0``) is started, but the launcher says that its store can be reached from other machines.
- Processes are awaited through pidfds (no polling); the ranks are forked before the store's thread
  starts, so the pre-exec hook runs in a single-threaded parent.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

from gspo_megatron.core.listeners import listen_on

STOP_GRACE_S = 30.0
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGINT, signal.SIGTERM)


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``signum`` to this process when the thread that forked it exits (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m gspo_megatron.launcher", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address; the store listens only there")
    parser.add_argument("--master-port", type=int, default=0, help="0: any free port (one node only)")
    parser.add_argument(
        "--script",
        default=None,
        help="a Python script every rank runs instead of the trainer (e.g. tools/convert_checkpoint.py); "
        "the remaining arguments are its own",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        parser.error(f"need nproc-per-node >= 1 and 0 <= node-rank < nnodes; got {vars(args)}")
    if args.nnodes > 1 and args.master_port == 0:
        parser.error("--master-port is required with several nodes (every node dials it)")
    return args, overrides


def _listen(address: str, port: int) -> socket.socket:
    try:
        return listen_on(address, port)
    except OSError as error:
        raise SystemExit(f"launcher: {error} (--master-addr)") from None


def _start_rank(args, overrides: list[str], local_rank: int, port: int) -> subprocess.Popen:
    world = args.nnodes * args.nproc_per_node
    env = dict(
        os.environ,
        RANK=str(args.node_rank * args.nproc_per_node + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(args.nproc_per_node),
        GROUP_RANK=str(args.node_rank),
        MASTER_ADDR=args.master_addr,
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # attach to the store served here; no rank serves one
        TORCHELASTIC_RESTART_COUNT="0",
    )
    if args.nnodes == 1:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    program = [args.script] if args.script else ["-m", "gspo_megatron.train"]
    command = [sys.executable, *program, *overrides]
    return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_parent)


class _Ranks:
    """The running ranks: forward signals, stop the rest when one fails, collect the exit status."""

    def __init__(self, processes: list[subprocess.Popen]):
        self.processes = processes
        self.signalled: int | None = None
        self.failure: int | None = None
        self._selector = selectors.DefaultSelector()
        for process in processes:
            self._selector.register(os.pidfd_open(process.pid), selectors.EVENT_READ, process)

    def forward(self, signum: int, frame) -> None:
        self.signalled = self.signalled or signum
        for process in self.processes:
            if process.returncode is None:
                process.send_signal(signum)

    def wait(self) -> int:
        deadline: float | None = None
        while self._selector.get_map():
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = self._selector.select(timeout)
            if not events and deadline is not None:
                self._kill_remaining()
                deadline = None
            for key, _ in events:
                self._finished(key)
                if self.failure is not None and deadline is None and self._selector.get_map():
                    self._terminate_remaining()
                    deadline = time.monotonic() + STOP_GRACE_S
        if self.signalled is not None:
            return 128 + self.signalled
        return self.failure or 0

    def _finished(self, key) -> None:
        self._selector.unregister(key.fileobj)
        os.close(key.fd)
        code = key.data.wait()
        if code != 0 and self.failure is None:
            self.failure = 128 - code if code < 0 else code

    def _terminate_remaining(self) -> None:
        for process in self.processes:
            if process.returncode is None:
                process.terminate()

    def _kill_remaining(self) -> None:
        for process in self.processes:
            if process.returncode is None:
                process.kill()


def _beyond_loopback(address: str) -> bool:
    try:
        return not ipaddress.ip_address(socket.gethostbyname(address) if ":" not in address else address).is_loopback
    except (OSError, ValueError):
        return True


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse(sys.argv[1:] if argv is None else argv)
    serves_store = args.node_rank == 0
    if serves_store and args.nnodes == 1 and _beyond_loopback(args.master_addr):
        print(
            f"launcher: warning: one node, but the rendezvous store will listen on {args.master_addr}, which other "
            "machines can reach (it is unauthenticated); use --master-addr 127.0.0.1 unless they must",
            file=sys.stderr,
            flush=True,
        )
    listener = _listen(args.master_addr, args.master_port) if serves_store else None
    port = listener.getsockname()[1] if listener is not None else args.master_port
    ranks = _Ranks([_start_rank(args, overrides, local, port) for local in range(args.nproc_per_node)])
    for signum in FORWARDED:
        signal.signal(signum, ranks.forward)
    store = None
    if listener is not None:  # after the fork: the store's thread must not exist while ranks are forked
        import torch.distributed as dist

        store = dist.TCPStore(
            args.master_addr,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=STOP_GRACE_S),
            master_listen_fd=listener.detach(),  # the store owns (and closes) the socket from here
            use_libuv=True,
        )
    code = ranks.wait()
    del store
    return code


if __name__ == "__main__":
    sys.exit(main())
