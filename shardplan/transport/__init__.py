"""Transports, chosen by name. Optional dependencies (ray, nixl, mooncake) are imported only when one is chosen
(each adapter module imports its own package when the adapter is built).

    create("nccl", me=..., control=..., device=...)             torch.distributed pairs: NCCL on CUDA, gloo on CPU
    create("rdt:nccl" | "rdt:gloo" | "rdt:nixl", me=..., actor=..., handles=..., router=...)   Ray Direct Transport
    create("mooncake:tcp" | "mooncake:rdma", me=..., control=...)   Mooncake TransferEngine, one-sided writes

See base.py for the Protocol and docs/transports.md for each adapter's recipe and limits.
"""

from __future__ import annotations

from shardplan.transport.base import (
    Control,
    ControlForged,
    Done,
    MissingDependency,
    Peer,
    PeerAborted,
    PeerDied,
    PeerError,
    PeerTimeout,
    Pending,
    Tag,
    Transport,
    UnknownTransport,
    consumer_name,
    trainer_name,
)
from shardplan.transport.mooncake import MooncakeTransport
from shardplan.transport.nccl import NcclTransport
from shardplan.transport.rdt import RdtTransport

NAMES = ("nccl", "rdt:nccl", "rdt:gloo", "rdt:nixl", "mooncake:tcp", "mooncake:rdma")


def create(name: str, **options) -> Transport:
    """Build the adapter called `name`; `options` go to its constructor (see each module)."""
    if name == "nccl":
        return NcclTransport(**options)
    if name.startswith("rdt:") and name[4:] in ("nccl", "gloo", "nixl"):
        return RdtTransport(backend=name[4:], **options)
    if name.startswith("mooncake:") and name[9:] in ("tcp", "rdma"):
        return MooncakeTransport(protocol=name[9:], **options)
    raise UnknownTransport(f"unknown transport {name!r}: choose one of {', '.join(NAMES)}")


__all__ = [
    "NAMES",
    "create",
    "Control",
    "ControlForged",
    "Done",
    "MissingDependency",
    "Peer",
    "PeerAborted",
    "PeerDied",
    "PeerError",
    "PeerTimeout",
    "Pending",
    "Tag",
    "Transport",
    "UnknownTransport",
    "consumer_name",
    "trainer_name",
]
