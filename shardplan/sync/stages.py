"""What the sync engine needs from the other stages (trainer source, packer, unpacker), its config, errors and
results. Pure declarations: every other sync module imports this one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence

import torch

from shardplan.errors import ShardplanError
from shardplan.plan.ir import TensorMeta
from shardplan.runtime.shards import Box
from shardplan.transport.base import Peer, PeerError


@dataclass(frozen=True, slots=True)
class Span:
    """`nbytes` at byte `offset` of a consumer's packed buffer for one group, made from the checkpoint tensors
    `sources`: a trainer can produce it if it holds all of them whole, or, when `only` is set, if it is one of
    those trainer ranks (segments cut from trainer-local shards by shardplan.runtime.shards)."""

    offset: int
    nbytes: int
    sources: tuple[str, ...]
    only: tuple[int, ...] = ()
    direct: bool = False  # its bytes are one contiguous range of one source: sent from it (Packer.direct_view)


@dataclass(frozen=True)
class Replicas:
    """Consumer ids when one sync feeds `count` replicas of one plan's layout (independent engines that all serve the
    plan's ranks): replica r's plan rank p is consumer `r * world + p`, where `world` is the plan's highest rank + 1.
    Each replica is a consumer set of its own on the wire (own lanes, buffers and results); both sides compute the
    same ids from the same plan file. One replica (the default) leaves consumer ids equal to plan ranks."""

    world: int
    count: int = 1

    @classmethod
    def of(cls, plan_ranks: Sequence[int], count: int = 1) -> "Replicas":
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise SyncConfigError(f"replicas must be a positive int, got {count!r} ({type(count).__name__})")
        return cls(max(plan_ranks, default=0) + 1, count)

    def consumer(self, replica: int, plan_rank: int) -> int:
        if not 0 <= replica < self.count:
            raise SyncConfigError(f"replica {replica} is outside 0..{self.count - 1} ({self.count} replicas)")
        return replica * self.world + plan_rank

    def consumers(self, plan_ranks: Sequence[int]) -> list[int]:
        return [self.consumer(r, p) for r in range(self.count) for p in sorted(plan_ranks)]

    def plan_rank(self, consumer: int) -> int:
        return consumer % self.world

    def replica(self, consumer: int) -> int:
        return consumer // self.world


class WeightSource(Protocol):
    """Trainer side: the checkpoint tensors this rank holds (in the spirit of vLLM's WeightSource)."""

    def metadata(self) -> Mapping[str, TensorMeta]:
        """Full (unsharded) name, shape and dtype of every tensor this rank holds any part of."""

    def boxes(self) -> Mapping[str, Box]:
        """Which box of each tensor this rank holds. The scheduler uses only whole boxes (see docs/transports.md)."""

    def group(self, group: str) -> Mapping[str, torch.Tensor]:
        """This rank's tensors of one weight group, ready to pack (e.g. gathered for this group only). They may be
        sent from as they are (direct spans), so they must keep their values until the sync returns (a buffer reused
        for the next group would fail the consumer's checksum)."""


class Packer(Protocol):
    """Trainer side: turns checkpoint tensors into each consumer's packed bytes (replay.Replayer behind an adapter)."""

    def consumers(self) -> Sequence[int]: ...

    def groups(self) -> Sequence[str]:
        """Weight groups in sync order (one per decoder layer, then the rest)."""

    def spans(self, consumer: int, group: str) -> Sequence[Span]:
        """The consumer's packed buffer for one group, segment by segment, in offset order."""

    def pack(
        self, consumer: int, group: str, tensors: Mapping[str, torch.Tensor], out: torch.Tensor, segments: Sequence[int]
    ) -> None:
        """Write the listed spans (indices into spans()) into `out` (uint8) at their offsets, from `tensors`: what
        the source handed for this sync (never tensors of an earlier one)."""

    def stamp(self, consumer: int) -> str:
        """The consumer plan rank(s) and a digest of the bytes' arrangement for that consumer (pack layout, fallback
        slots): compared with the consumer's own stamp before any byte moves."""

    # optional: direct_view(consumer, group, tensors, segment) -> uint8 tensor | None. The bytes of a span reported
    # `direct`, as a view of the tensor they come from (None: that tensor cannot be sent from; it is packed instead)


class Unpacker(Protocol):
    """Consumer side: scatters one group's packed bytes into the live params (apply.Applier behind an adapter)."""

    def sizes(self) -> Mapping[str, int]:
        """Bytes of this consumer's packed buffer per group (sizes the receive buffers, once)."""

    def apply(self, group: str, buffer: torch.Tensor) -> None: ...

    def stamp(self) -> str:
        """This consumer's plan rank and pack-layout digest (see Packer.stamp)."""

    # optional: receive_targets(group, [(lo, hi), ...]) -> [uint8 tensor | None, ...]. Per message of a group, when its
    # receives are posted (in sync order): where to receive it instead of the buffer (None: the buffer); apply skips it


@dataclass(kw_only=True)
class SyncConfig:
    timeout_s: float = 30.0
    """Longest a consumer waits for one group's bytes from one trainer (trainers give consumers 1.5x that)."""
    verify: bool = True
    """Checksum every piece on both sides; a mismatch fails the consumer's sync (ChecksumMismatch)."""
    announce_timeout_s: float = 600.0
    """Longest a rank waits for the coordinator to announce the version it was asked to sync."""

    def __post_init__(self):
        for field in ("timeout_s", "announce_timeout_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise SyncConfigError(
                    f"SyncConfig: {field} must be a positive finite number of seconds, got "
                    f"{value!r} ({type(value).__name__})"
                )
        if not isinstance(self.verify, bool):
            raise SyncConfigError(
                f"SyncConfig: verify must be True or False, got {self.verify!r} ({type(self.verify).__name__})"
            )


class SyncConfigError(ShardplanError, ValueError):
    """A SyncConfig value out of range."""


# ---- errors and results ----------------------------------------------------------------------------------------------
class ScheduleError(ShardplanError):
    """No schedule exists: some consumer needs a tensor no live trainer holds whole, or the two sides' plans differ."""


class LayoutMismatch(PeerError):
    """A trainer packs a consumer's bytes in another arrangement than the consumer applies them (different plans, a
    wrong rank mapping, another max_group_bytes): refused before any byte moves, on both sides."""


class ChecksumMismatch(PeerError):
    """Bytes from this trainer arrived but differ from what it packed."""


class NotAMember(ShardplanError):
    """This rank is not part of the announced version (it failed or was restarted); it re-joined for the next one."""


class SyncFailed(ShardplanError):
    """This rank's part of a sync did not complete. `failures` maps each failed peer's name to its error."""

    def __init__(self, rank: str, version: int, failures: Mapping[Peer, BaseException]):
        self.rank, self.version, self.failures = rank, version, dict(failures)
        lines = "; ".join(f"{peer}: {type(e).__name__}: {e}" for peer, e in sorted(self.failures.items()))
        super().__init__(f"{rank}: sync of version {version} failed for {', '.join(sorted(self.failures))} ({lines})")

    def __reduce__(self):
        return (SyncFailed, (self.rank, self.version, self.failures))


class SyncState(NamedTuple):
    version: int
    complete: bool


@dataclass
class SyncReport:
    rank: str
    version: int
    seconds: float
    nbytes: int  # bytes this rank sent (trainer) or received (consumer)
    peers: tuple[str, ...] = ()  # peers it exchanged bytes with
    direct_nbytes: int = 0  # trainer: bytes of those sent from its own tensors (no copy into staging)


# ---- engine events: a benchmark may listen (bench/sync_bench.py --trace); nothing is recorded otherwise -----------
_listener: Callable[[str], None] | None = None


def set_event_listener(listener: Callable[[str], None] | None) -> None:
    """Call `listener(event)` at each engine step ("pack 3 enqueued", "received 3", ...), from the thread doing it."""
    global _listener
    _listener = listener


def event(name: str) -> None:
    if _listener is not None:
        _listener(name)
