"""The control channel's client pool is keyed by address: a server served again on a port an earlier (closed)
server had must not be handed that server's pooled clients (they read a closed socket: "got 0 bytes")."""

import gc
import socket

from shardplan.transport.base import Control


def test_a_new_server_on_a_reused_port_gets_fresh_clients():
    first = Control.serve()
    first.set("k", "old")
    assert first.try_get("k") == "old"
    port = first.port
    del first
    gc.collect()  # the TCPStore server closes with its last reference
    second = Control.serve(port=port)
    assert second.port == port
    assert second.try_get("k") is None
    second.set("k", "new")
    assert second.try_get("k") == "new"


def _listening(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port` (/proc/net/tcp and tcp6, state 0A = LISTEN)."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(name).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)
                if len(raw) == 4:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_the_store_listens_only_on_the_address_asked_for():
    control = Control.serve("127.0.0.1")
    control.set("k", "v")
    assert control.try_get("k") == "v"
    assert _listening(control.port) == {"127.0.0.1"}, "the control store listens beyond 127.0.0.1"
