"""Control-channel keys and marks of the sync protocol (see shardplan.sync for the key table)."""

from __future__ import annotations

import base64
import json
import re
from typing import Iterable, Iterator, Mapping

import numpy as np

from shardplan.plan.names import base_group
from shardplan.sync.schedule import CHECKSUM
from shardplan.sync.stages import ChecksumMismatch
from shardplan.transport.base import Control, Peer, consumer_name, trainer_name

PROTOCOL = 2
"""Version of the sync protocol, carried in every stamp a rank publishes when it joins (wire_stamp), so that a peer
of another version is refused by name in prepare (LayoutMismatch, before any byte moves) rather than failing every
piece as a checksum mismatch. 2: the checksum that sees swapped words (schedule.CHECKSUM); 1: the plain wrapping sum
of int64 words, from before stamps carried a version (a stamp without one is version 1). An older peer, which knows
no version, refuses a newer one as a stamp that differs from its own, the version named in its message."""


def wire_stamp(stamp: str) -> str:
    """A Packer's or Unpacker's stamp as this rank publishes and compares it: with the sync protocol's version."""
    return f"{stamp} [sync protocol {PROTOCOL}: {CHECKSUM} checksum]"


def stamp_protocol(stamp: str) -> int:
    """The sync protocol version a published stamp names (1: none named)."""
    found = re.search(r" \[sync protocol (\d+)\b", stamp)
    return int(found.group(1)) if found else 1


def announce_key(v: int) -> str:
    return f"v{v}/announce"


def free_key(v: int, consumer: Peer, g: int) -> str:
    return f"v{v}/free/{consumer}/{g}"


def done_key(v: int, trainer: Peer, consumer: Peer, g: int) -> str:
    return f"v{v}/done/{trainer}/{consumer}/{g}"


def result_key(v: int, rank: Peer) -> str:
    return f"v{v}/result/{rank}"


def amax_key(v: int, trainer: Peer, group: str) -> str:
    return f"v{v}/amax/{trainer}/{group}"


def placement_key(v: int, consumer: Peer) -> str:
    return f"v{v}/placement/{consumer}"


def bound_key(v: int, trainer: Peer, consumer: Peer) -> str:  # the placement digest a trainer bound to (EPLB)
    return f"v{v}/bound/{trainer}/{consumer}"


def version_keys(v: int, members: Iterable[Peer], schedule) -> Iterator[str]:
    """Every key version `v` may have left in the store (its members, its Schedule): what the coordinator deletes two
    versions later, or the store would grow by every version's marks (MiBs per version with EPLB placements)."""
    yield announce_key(v)
    for name in members:
        yield result_key(v, name)
    groups = {base_group(g) for g in schedule.groups}
    for t in schedule.trainers:
        yield from (amax_key(v, trainer_name(t), g) for g in groups)
    for c in schedule.consumers:
        yield placement_key(v, consumer_name(c))
        yield from (bound_key(v, trainer_name(t), consumer_name(c)) for t in schedule.trainers)
        for gi in range(len(schedule.groups)):
            yield free_key(v, consumer_name(c), gi)
            for t in sorted({p.trainer for p in schedule.of(c, gi)}):
                yield done_key(v, trainer_name(t), consumer_name(c), gi)


def encode_amaxes(partials: Mapping[str, np.ndarray]) -> str:
    """A trainer's partial block amaxes of one group (ShardedPacker.partial_amaxes) as control-channel text."""
    out = {}
    for name, grid in partials.items():
        grid = np.ascontiguousarray(grid, dtype=np.float32)
        out[name] = [list(grid.shape), base64.b64encode(grid.tobytes()).decode()]
    return json.dumps(out)


def decode_amaxes(text: str) -> dict[str, np.ndarray]:
    return {
        name: np.frombuffer(base64.b64decode(data), dtype=np.float32).reshape(shape)
        for name, (shape, data) in json.loads(text).items()
    }


def join(
    control: Control, name: Peer, held: frozenset[str] | None = None, stamps: Mapping[int, str] | None = None
) -> int:
    """(Re-)join with a new epoch. A trainer says which tensors it holds whole (`held`) and, like a consumer, the
    stamp of each consumer's bytes as it arranges them (consumer rank -> Packer/Unpacker stamp; published with the
    protocol version, wire_stamp)."""
    epoch = control.add(f"epoch/{name}", 1)  # monotonic across restarts: a new incarnation never reuses an epoch
    control.set(
        f"join/{name}",
        json.dumps(
            {
                "epoch": epoch,
                "held": None if held is None else sorted(held),
                "stamps": {str(c): wire_stamp(s) for c, s in (stamps or {}).items()},
            }
        ),
    )
    return epoch


def check_sum(peer: Peer, mark: str, j: int, got: int, lo: int, hi: int, group: str) -> None:
    """Compare the consumer's checksum of bytes [lo, hi) of a group with the one its trainer wrote in its "done" mark
    (the j-th of its messages in the group: Piece.messages)."""
    expected = json.loads(mark)["sums"][j]
    if expected != got:
        raise ChecksumMismatch(peer, f"bytes [{lo}, {hi}) of {group}: checksum {got}, trainer packed {expected}")


def abort_mark(control: Control, key: str) -> str | None:
    """The abort message a peer left at `key`, if any (None while the key is unset or holds a normal mark)."""
    value = control.try_get(key)
    return value if value is not None and value.startswith("abort") else None
