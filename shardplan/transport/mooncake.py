"""`mooncake:tcp` / `mooncake:rdma`: Mooncake TransferEngine, one-sided writes into the consumer's registered buffers.

Recipe: each endpoint starts a TransferEngine with P2P handshake metadata (no etcd/metadata server):
`initialize(hostname, "P2PHANDSHAKE", "tcp" | "rdma", device_name)`; registers its few big buffers once
(`register_memory(ptr, nbytes)`); consumers publish `{address: "host:rpc_port", buffers: [ptr...]}` on the control
channel. A trainer writes a view of its staging buffer straight into `buffers[tag.slot] + tag.offset` on the consumer
(`transfer_submit_write`, polled with `transfer_check_status` against a deadline), then the engine's "done" mark tells
the consumer the bytes are there. The consumer posts nothing.

A dead consumer refuses the connection: the write fails at once (status < 0) and is reported as PeerDied.
Install: `pip install mooncake-transfer-engine` (CUDA 12 build) or `mooncake-transfer-engine-non-cuda` (CPU machines);
both need the system package libibverbs1 (Debian/Ubuntu: `apt-get install -y libibverbs1`) even for "tcp".
"""

from __future__ import annotations

import json
import threading
from typing import Mapping, Sequence

import torch

from shardplan.errors import ShardplanError
from shardplan.transport.base import (
    Control,
    Done,
    Failed,
    MissingDependency,
    Peer,
    PeerDied,
    PeerTimeout,
    Tag,
    deadline_after,
    left,
)


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        hint = (
            "pip install mooncake-transfer-engine   (CUDA 12 machines)\n"
            "pip install mooncake-transfer-engine-non-cuda   (CPU-only machines)\n"
            "and the system library: apt-get install -y libibverbs1"
        )
        raise MissingDependency(
            f"transport 'mooncake:*' needs Mooncake's TransferEngine ({e}). Install:\n{hint}"
        ) from e
    return TransferEngine


class _Write:
    def __init__(self, engine, batch: int, peer: Peer):
        self.engine, self.batch, self.peer = engine, batch, peer

    def wait(self, timeout_s: float, check=None) -> None:  # `check` unused: the lane polls marks itself
        deadline = deadline_after(timeout_s)
        pause = threading.Event()
        while True:
            status = self.engine.transfer_check_status(self.batch)
            if status == 1:
                return
            if status < 0:
                raise PeerDied(self.peer, f"Mooncake write failed (status {status}): peer unreachable or gone")
            if left(deadline) == 0:
                raise PeerTimeout(self.peer, f"Mooncake write did not finish within {timeout_s:.1f} s")
            pause.wait(0.0002)


class MooncakeTransport:
    """Options: `me`, `control`, `protocol` ("tcp" | "rdma"), `hostname` (address peers reach this endpoint on; keep
    127.0.0.1 in tests), `device_name` (RDMA NIC list for "rdma", e.g. "mlx5_0"), `timeout_s`."""

    one_sided = True

    def __init__(
        self,
        *,
        me: Peer,
        control: Control,
        protocol: str = "tcp",
        hostname: str = "127.0.0.1",
        device_name: str = "",
        timeout_s: float = 30.0,
        device: torch.device | str | None = None,
    ):
        engine_cls = _import_engine()
        self.me, self.control, self.timeout_s = me, control, timeout_s
        self.engine = engine_cls()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise ShardplanError(
                f"{me}: Mooncake TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) returned {rc}; for 'rdma' check device_name and the RDMA NICs"
            )
        self.address = f"{hostname}:{self.engine.get_rpc_port()}"
        self.buffers: list[torch.Tensor] = []
        self.peers: dict[Peer, tuple[int, dict]] = {}  # peer -> (epoch, its published record)
        self.broken: dict[Peer, Exception] = {}

    def register(self, buffers: Sequence[torch.Tensor]) -> None:
        for buf in buffers:
            rc = self.engine.register_memory(buf.data_ptr(), buf.numel() * buf.element_size())
            if rc != 0:
                raise ShardplanError(
                    f"{self.me}: Mooncake register_memory of {buf.numel() * buf.element_size()} bytes returned {rc}"
                )
        self.buffers = list(buffers)  # keep them alive: the engine holds raw pointers
        record = {
            "address": self.address,
            "buffers": [b.data_ptr() for b in buffers],
            "sizes": [b.numel() * b.element_size() for b in buffers],
        }
        self.control.set(f"mooncake/{self.me}", json.dumps(record))

    def connect(self, peers: Mapping[Peer, int]) -> None:
        self.broken = {}
        for peer, epoch in peers.items():
            if peer == self.me or not self.me.startswith("trainer"):
                continue  # only writers need the peer's address book
            if self.peers.get(peer, (None,))[0] == epoch:
                continue
            try:
                record = json.loads(self.control.get(f"mooncake/{peer}", self.timeout_s, peer, "Mooncake address"))
                self.peers[peer] = (epoch, record)
            except Exception as e:  # noqa: BLE001 - raised from this peer's next send
                self.peers.pop(peer, None)
                self.broken[peer] = e

    def send(self, peer: Peer, src: torch.Tensor, tag: Tag):
        if tag.nbytes == 0:
            return Done()
        if peer in self.broken:
            return Failed(self.broken[peer])
        entry = self.peers.get(peer)
        if entry is None:
            return Failed(PeerDied(peer, "not connected in this version"))
        record = entry[1]
        if tag.offset + tag.nbytes > record["sizes"][tag.slot]:
            raise ShardplanError(
                f"{self.me}: write of {tag.nbytes} bytes at {tag.offset} overruns {peer}'s receive "
                f"buffer {tag.slot} ({record['sizes'][tag.slot]} bytes): the plans of the two sides differ"
            )
        batch = self.engine.transfer_submit_write(
            record["address"], src.data_ptr(), record["buffers"][tag.slot] + tag.offset, tag.nbytes
        )
        if batch < 0:
            return Failed(PeerDied(peer, f"Mooncake refused the write (code {batch})"))
        return _Write(self.engine, batch, peer)

    def recv(self, peer: Peer, dst: torch.Tensor, tag: Tag):
        return Done()  # one-sided: the trainer's done mark announces arrival

    def close(self) -> None:
        for buf in self.buffers:
            try:
                self.engine.unregister_memory(buf.data_ptr())
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self.buffers = []
