"""A store the project serves listens on the address it was given and nowhere else (issue 63)."""

from __future__ import annotations

import psutil
import pytest

from gspo_megatron.core.listeners import listen_on, serve_store
from gspo_megatron.testing.listeners import listening_addresses, non_loopback_ipv4, reachable


def local_addresses() -> set[str]:
    return {address.address for addresses in psutil.net_if_addrs().values() for address in addresses}


def test_a_store_served_on_loopback_listens_there_only():
    store = serve_store("127.0.0.1", 0, timeout_s=10)
    assert listening_addresses(store.port) == {"127.0.0.1"}  # torch's own TCPStore server: {"::"}
    store.set("key", "value")
    assert store.get("key") == b"value"
    other = non_loopback_ipv4()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    assert not reachable(other, store.port)  # another host cannot reach the store


def test_port_0_is_a_free_port_bound_at_once():
    first, second = serve_store("127.0.0.1", 0, timeout_s=10), serve_store("127.0.0.1", 0, timeout_s=10)
    assert first.port != second.port and first.port > 0


def test_an_address_not_of_this_machine_is_named():
    foreign = "203.0.113.254"  # TEST-NET-3 (RFC 5737): documentation only
    assert foreign not in local_addresses(), "the test's foreign address is this machine's: choose another"
    with pytest.raises(OSError, match=r"cannot listen on 203\.0\.113\.254:0 .* an address of this machine"):
        listen_on(foreign, 0)
