"""The control channel's client pool is keyed by address: a server served again on a port an earlier (closed)
server had must not be handed that server's pooled clients (they read a closed socket: "got 0 bytes")."""

import gc

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
