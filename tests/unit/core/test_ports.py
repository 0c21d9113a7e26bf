"""A port chosen now and bound later by another process lies outside the kernel's ephemeral range (core/ports.py):
CI's two pytest workers saw a gloo rendezvous fail with EADDRINUSE on the port bind(0) had just handed out."""

from __future__ import annotations

import socket

from gspo_megatron.core import ports


def test_the_port_is_free_and_below_the_range_outgoing_connections_draw_from():
    low, high = ports.ephemeral_range()
    assert 0 < low <= high
    chosen = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST <= port < low for port in chosen)  # before: bind(0), inside [low, high]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", chosen.pop()))  # free: it binds


def test_a_taken_port_is_not_handed_out(monkeypatch):
    free = ports.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        draws = iter([busy, busy, free])  # the drawn ports, in turn: the taken one twice, then a free one
        monkeypatch.setattr(ports.random, "randint", lambda low, high: next(draws))
        assert ports.free_port() == free
