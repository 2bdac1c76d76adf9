"""The sync engine: at every RL step, ship each consumer (inference) rank exactly its bytes from the trainer ranks.

Roles and what each one calls
-----------------------------
    Coordinator (driver)      announce(version): who takes part, and the schedule id, on the control channel
    TrainerSync (per trainer) sync(version): pack each consumer's groups, send them, mark them done
    ConsumerSync (per cons.)  sync(version): receive into two registered buffers, verify, apply; state -> (version, complete)

The data path per (trainer, consumer) pair is a *lane*: a thread on the trainer that, for each weight group (one
decoder layer) the pair shares, packs the group into one of two staging slots, waits for the consumer's "slot free"
mark, sends, and then marks the *previous* group done (with checksums). So packing group N+1 overlaps the transfer of
N, and at most two groups are in flight per side. The consumer posts receives for groups N and N+1 (marking both
slots free), waits for N's done marks, verifies, applies N while N+1 is in flight, then re-posts the slot for N+2.

Control channel keys (values are short strings or JSON):
    join/<rank>                      {"epoch", "held"}    a rank (re)starting; trainers say which tensors they hold whole
    schedule/<id>                    the Schedule (JSON)  written once per membership
    v<V>/announce                    {"schedule", "members": {rank: epoch}}
    v<V>/free/<consumer>/<g>         "ok <unix time>" | "abort: ..."        consumer -> its trainers
    v<V>/done/<trainer>/<consumer>/<g>  {"sums": [...]} | "abort: ..."      trainer -> consumer, after the send finished
    v<V>/result/<rank>               {"ok", "epoch", "errors"}

Failure model
-------------
Every wait has a deadline and names the peer it waited for. A consumer waits `timeout_s` for each group's bytes from
each of its trainers; a trainer waits `1.5 * timeout_s` for a consumer (the consumer may itself be waiting up to
`timeout_s` on another trainer, and must be the first to give up, so nobody blames a bystander). Whoever gives up
writes "abort: <why>" into every mark the other side may still wait on, so peers end at once instead of timing out.
A lane's failure never stops the other lanes: surviving consumers complete (degraded sync). Each rank that saw any
failure bumps its epoch (so adapters re-open its connections), records its result, and raises SyncFailed naming the
peers. The coordinator leaves out of the next version every rank that wrote no result (dead or stalled) and brings
back any rank that re-joined (a restart writes `join/<rank>` with a fresh epoch). A consumer's `state` says
(version, complete): complete only when every byte of that version arrived, matched its checksum and was applied;
(new version, False) as soon as the first group of a version was applied.

Checksum: sum of the buffer as int32 words (plus tail bytes) into int64; cheap on CPU and GPU; catches missing,
zeroed, truncated or stale pieces, not swapped words.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Protocol, Sequence

import torch

from shardplan.errors import ShardplanError
from shardplan.ir import TensorMeta
from shardplan.transport.base import (Control, Peer, PeerAborted, PeerError, Tag, Transport, consumer_name,
                                      deadline_after, left, trainer_name)

# ---- timeline tracing (benchmarks): SHARDPLAN_TRACE=1 records (wall time, thread, event) per engine step ---------------
TRACE: list[tuple[float, str, str]] | None = [] if os.environ.get("SHARDPLAN_TRACE") else None


def _trace(event: str) -> None:
    if TRACE is not None:
        TRACE.append((time.time(), threading.current_thread().name, event))


# ---- what the engine needs from the other stages ---------------------------------------------------------------------
Box = tuple[tuple[int, int], ...]   # [start, stop) per dimension


@dataclass(frozen=True, slots=True)
class Segment:
    """`nbytes` at byte `offset` of a consumer's packed buffer for one group, made from the checkpoint tensors
    `sources`: a trainer can produce it if it holds all of them whole, or, when `only` is set, if it is one of
    those trainer ranks (segments cut from trainer-local shards by shardplan.shards)."""
    offset: int
    nbytes: int
    sources: tuple[str, ...]
    only: tuple[int, ...] = ()


class WeightSource(Protocol):
    """Trainer side: the checkpoint tensors this rank holds (in the spirit of vLLM's WeightSource)."""

    def metadata(self) -> Mapping[str, TensorMeta]:
        """Full (unsharded) name, shape and dtype of every tensor this rank holds any part of."""

    def boxes(self) -> Mapping[str, Box]:
        """Which box of each tensor this rank holds. The scheduler uses only whole boxes (see docs/transports.md)."""

    def group(self, group: str) -> Mapping[str, torch.Tensor]:
        """This rank's tensors of one weight group, ready to pack (e.g. gathered for this group only)."""


class Packer(Protocol):
    """Trainer side: turns checkpoint tensors into each consumer's packed bytes (replay.Replayer behind an adapter)."""

    def consumers(self) -> Sequence[int]: ...

    def groups(self) -> Sequence[str]:
        """Weight groups in sync order (one per decoder layer, then the rest)."""

    def layout(self, consumer: int, group: str) -> Sequence[Segment]:
        """The consumer's packed buffer for one group, segment by segment, in offset order."""

    def pack(self, consumer: int, group: str, tensors: Mapping[str, torch.Tensor], out: torch.Tensor,
             segments: Sequence[int]) -> None:
        """Write the listed segments (indices into layout()) into `out` (uint8) at their offsets."""


class Unpacker(Protocol):
    """Consumer side: scatters one group's packed bytes into the live params (apply.Applier behind an adapter)."""

    def sizes(self) -> Mapping[str, int]:
        """Bytes of this consumer's packed buffer per group (sizes the receive buffers, once)."""

    def apply(self, group: str, buffer: torch.Tensor) -> None: ...


@dataclass(kw_only=True)
class SyncConfig:
    timeout_s: float = 30.0
    """Longest a consumer waits for one group's bytes from one trainer (trainers give consumers 1.5x that)."""
    verify: bool = True
    """Checksum every piece on both sides; a mismatch fails the consumer's sync (ChecksumMismatch)."""
    announce_timeout_s: float = 600.0
    """Longest a rank waits for the coordinator to announce the version it was asked to sync."""

    def __post_init__(self):
        if self.timeout_s <= 0 or self.announce_timeout_s <= 0:
            raise ValueError("SyncConfig: timeouts must be positive")


# ---- errors and results ----------------------------------------------------------------------------------------------------
class ScheduleError(ShardplanError):
    """No schedule exists: some consumer needs a tensor no live trainer holds whole, or the two sides' plans differ."""


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
    nbytes: int                       # bytes this rank sent (trainer) or received (consumer)
    peers: tuple[str, ...] = ()       # peers it exchanged bytes with


# ---- the static schedule -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [lo, hi) of a consumer's group buffer, packed and sent by one trainer (segments: layout indices)."""
    trainer: int
    lo: int
    hi: int
    segments: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    groups: tuple[str, ...]
    trainers: tuple[int, ...]
    consumers: tuple[int, ...]
    nbytes: Mapping[int, tuple[int, ...]]                # consumer -> end of its last segment, per group
    pieces: Mapping[tuple[int, int], tuple[Piece, ...]]  # (consumer, group index) -> pieces in byte order

    def of(self, consumer: int, group_index: int, trainer: int | None = None) -> tuple[Piece, ...]:
        pieces = self.pieces.get((consumer, group_index), ())
        return pieces if trainer is None else tuple(p for p in pieces if p.trainer == trainer)

    def bytes_by_trainer(self) -> dict[int, int]:
        out = {t: 0 for t in self.trainers}
        for pieces in self.pieces.values():
            for p in pieces:
                out[p.trainer] += p.hi - p.lo
        return out

    def to_json(self) -> str:
        return json.dumps({"groups": list(self.groups), "trainers": list(self.trainers),
                           "consumers": list(self.consumers), "nbytes": {str(c): list(n) for c, n in self.nbytes.items()},
                           "pieces": [[c, g, p.trainer, p.lo, p.hi, list(p.segments)]
                                      for (c, g), ps in sorted(self.pieces.items()) for p in ps]})

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        d = json.loads(text)
        pieces: dict[tuple[int, int], list[Piece]] = {}
        for c, g, t, lo, hi, segs in d["pieces"]:
            pieces.setdefault((c, g), []).append(Piece(t, lo, hi, tuple(segs)))
        return cls(tuple(d["groups"]), tuple(d["trainers"]), tuple(d["consumers"]),
                   {int(c): tuple(n) for c, n in d["nbytes"].items()}, {k: tuple(v) for k, v in pieces.items()})


def build_schedule(layouts: Mapping[int, Mapping[str, Sequence[Segment]]], groups: Sequence[str],
                   held: Mapping[int, frozenset[str] | None], trainers: Sequence[int],
                   consumers: Sequence[int]) -> Schedule:
    """Which trainer serves which bytes of which consumer, per group; computed once per membership.

    `held[t]`: the tensors trainer t holds whole (None: all of them). Per group: each consumer's segments are cut into
    runs with the same set of eligible trainers, each run into ceil(#trainers / #consumers) chunks of about equal
    bytes (so more trainers than consumers still all work), and the chunks go largest-first to the eligible trainer
    with the least bytes in this group (then overall): balanced per pipeline step and contiguous per consumer.
    """
    if not trainers:
        raise ScheduleError("no live trainer rank: nothing can serve the sync")
    trainers, consumers = tuple(sorted(trainers)), tuple(sorted(consumers))
    chunks_per_run = max(1, math.ceil(len(trainers) / max(len(consumers), 1)))
    total = {t: 0 for t in trainers}
    nbytes: dict[int, list[int]] = {c: [] for c in consumers}
    pieces: dict[tuple[int, int], tuple[Piece, ...]] = {}
    for gi, group in enumerate(groups):
        chunks: list[tuple[int, list[int], int, tuple[int, ...]]] = []   # (consumer, segment indices, bytes, eligible)
        for c in consumers:
            segs = list(layouts[c].get(group, ()))
            nbytes[c].append(max((s.offset + s.nbytes for s in segs), default=0))
            run: list[int] = []
            run_eligible: tuple[int, ...] = ()
            for i, seg in enumerate(segs):
                if seg.nbytes == 0:
                    continue
                if seg.only:
                    eligible = tuple(t for t in trainers if t in seg.only)
                else:
                    eligible = tuple(t for t in trainers if held[t] is None or all(n in held[t] for n in seg.sources))
                if not eligible:
                    if seg.only:
                        raise ScheduleError(f"{consumer_name(c)}, group {group}: bytes at {seg.offset} come only from "
                                            f"trainer {list(seg.only)}, which is not live; re-plan the shards "
                                            f"(shardplan.shards.plan_shards) without it")
                    missing = sorted(n for n in seg.sources if not any(held[t] is None or n in held[t] for t in trainers))
                    raise ScheduleError(f"{consumer_name(c)}, group {group}: no live trainer holds {missing} whole "
                                        f"(live trainers: {list(trainers)}); restore the trainer that holds them, or "
                                        f"have the WeightSource gather them")
                if run and eligible != run_eligible:
                    chunks += _split_run(c, run, segs, run_eligible, chunks_per_run)
                    run = []
                run.append(i)
                run_eligible = eligible
            if run:
                chunks += _split_run(c, run, segs, run_eligible, chunks_per_run)
        load = {t: 0 for t in trainers}
        owner: dict[tuple[int, int], int] = {}   # (consumer, first segment of chunk) -> trainer
        for c, idx, size, eligible in sorted(chunks, key=lambda ch: (-ch[2], ch[0], ch[1][0])):
            t = min(eligible, key=lambda t: (load[t], total[t], t))
            load[t] += size
            total[t] += size
            owner[(c, idx[0])] = t
        for c in consumers:
            segs = list(layouts[c].get(group, ()))
            mine = sorted((ch for ch in chunks if ch[0] == c), key=lambda ch: ch[1][0])
            merged: list[Piece] = []
            for _, idx, _, _ in mine:
                t = owner[(c, idx[0])]
                lo, hi = segs[idx[0]].offset, segs[idx[-1]].offset + segs[idx[-1]].nbytes
                if merged and merged[-1].trainer == t and merged[-1].segments[-1] + 1 == idx[0] \
                        and all(segs[j].nbytes == 0 for j in range(merged[-1].segments[-1] + 1, idx[0])):
                    prev = merged.pop()
                    merged.append(Piece(t, prev.lo, hi, prev.segments + tuple(idx)))
                else:
                    merged.append(Piece(t, lo, hi, tuple(idx)))
            if merged:
                pieces[(c, gi)] = tuple(merged)
    return Schedule(tuple(groups), trainers, consumers, {c: tuple(n) for c, n in nbytes.items()}, pieces)


def _split_run(c: int, run: list[int], segs: list[Segment], eligible: tuple[int, ...], parts: int):
    parts = min(parts, len(eligible), len(run))
    size = sum(segs[i].nbytes for i in run)
    out, cur, acc, cut = [], [], 0, 1
    for i in run:
        cur.append(i)
        acc += segs[i].nbytes
        if cut < parts and acc >= size * cut / parts:
            out.append((c, cur, sum(segs[j].nbytes for j in cur), eligible))
            cur, cut = [], cut + 1
    if cur:
        out.append((c, cur, sum(segs[j].nbytes for j in cur), eligible))
    return out


def held_whole(source: WeightSource, needed: set[str]) -> frozenset[str] | None:
    """Names of needed tensors the source holds whole; None when it holds all of them (saves publishing the list)."""
    meta, boxes = source.metadata(), source.boxes()
    whole = {n for n, box in boxes.items() if n in meta and tuple(box) == tuple((0, s) for s in meta[n].shape)}
    return None if needed <= whole else frozenset(whole & needed)


def checksum(view: torch.Tensor) -> int:
    """Sum of the bytes as int32 words (tail bytes added singly), in int64. Works on any device."""
    return int(checksum_tensor(view))


def checksum_tensor(view: torch.Tensor) -> torch.Tensor:
    """checksum() as a 0-d int64 tensor on the view's device: enqueued, not waited for (the two-sided pipeline reads
    it once the transfer it guards has finished)."""
    n = view.numel()
    words = n // 4 * 4 if view.data_ptr() % 4 == 0 else 0
    total = view[:words].view(torch.int32).sum(dtype=torch.int64) if words else \
        torch.zeros((), dtype=torch.int64, device=view.device)
    if words < n:
        total = total + view[words:].sum(dtype=torch.int64)
    return total


# ---- control channel keys --------------------------------------------------------------------------------------------------
def _announce_key(v: int) -> str:
    return f"v{v}/announce"


def _free_key(v: int, consumer: Peer, g: int) -> str:
    return f"v{v}/free/{consumer}/{g}"


def _done_key(v: int, trainer: Peer, consumer: Peer, g: int) -> str:
    return f"v{v}/done/{trainer}/{consumer}/{g}"


def _result_key(v: int, rank: Peer) -> str:
    return f"v{v}/result/{rank}"


def _join(control: Control, name: Peer, held: frozenset[str] | None = None) -> int:
    epoch = control.add(f"epoch/{name}", 1)   # monotonic across restarts: a new incarnation never reuses an epoch
    control.set(f"join/{name}", json.dumps({"epoch": epoch, "held": None if held is None else sorted(held)}))
    return epoch


# ---- coordinator --------------------------------------------------------------------------------------------------------
@dataclass
class Announcement:
    version: int
    schedule_id: str
    members: dict[str, int]            # rank name -> epoch
    excluded: tuple[str, ...] = ()


class Coordinator:
    """Decides, per version, who takes part, and publishes the schedule. Runs in the driver (or the launcher).

    `layouts[c][group]`: consumer c's segments per group (the same layouts the trainers' Packer reports)."""

    def __init__(self, control: Control, layouts: Mapping[int, Mapping[str, Sequence[Segment]]],
                 groups: Sequence[str], num_trainers: int, config: SyncConfig | None = None):
        self.control, self.layouts, self.groups = control, layouts, tuple(groups)
        self.trainers, self.consumers = tuple(range(num_trainers)), tuple(sorted(layouts))
        self.config = config or SyncConfig()
        self.members: dict[str, int] = {}
        self.last_version: int | None = None
        self._schedules: dict[tuple, str] = {}
        self._held: dict[int, frozenset[str] | None] = {}
        self._known: dict[str, int] = {}     # highest epoch seen per rank

    def names(self) -> list[str]:
        return [trainer_name(t) for t in self.trainers] + [consumer_name(c) for c in self.consumers]

    def results(self, version: int, timeout_s: float) -> dict[str, dict]:
        """Results of `version` from its members, waiting at most `timeout_s` in all; missing ranks are left out."""
        out, deadline = {}, deadline_after(timeout_s)
        for name in self.members:
            try:
                out[name] = json.loads(self.control.get(_result_key(version, name), left(deadline), name, "result"))
            except PeerError:
                pass
        return out

    def announce(self, version: int, wait_for_joins_s: float | None = None) -> Announcement:
        """Announce `version`: members are the ranks that reported a result for the last version (with the epoch they
        reported), plus ranks that (re-)joined since; ranks silent since the last version are excluded."""
        # a trainer's in-flight transfers may run up to 1.5x timeout after a consumer gave up: wait them out so no
        # write of the last version can land in a buffer of this one
        results = self.results(self.last_version, 2 * self.config.timeout_s) if self.last_version is not None else {}
        deadline = deadline_after(self.config.timeout_s if wait_for_joins_s is None else wait_for_joins_s)
        members: dict[str, int] = {}
        while True:
            for name in self.names():
                # alive at the last version: it wrote a result (with its epoch, bumped if it failed)
                epoch = results[name]["epoch"] if name in results else None
                joined = self.control.try_get(f"join/{name}")
                if joined is not None:
                    record = json.loads(joined)
                    if name.startswith("trainer"):
                        held = record["held"]
                        self._held[int(name[7:])] = None if held is None else frozenset(held)
                    # a join counts only if newer than anything seen from that rank: a dead rank's old join doesn't
                    if record["epoch"] > max(self._known.get(name, -1), epoch if epoch is not None else -1):
                        epoch = record["epoch"]
                if epoch is not None:
                    members[name] = epoch
            # the first version waits (bounded) for every rank to join; later versions take who is there
            if self.last_version is not None or len(members) == len(self.names()) or left(deadline) == 0:
                break
            time.sleep(0.05)
        for name, epoch in members.items():
            self._known[name] = max(self._known.get(name, -1), epoch)
        trainers = tuple(t for t in self.trainers if trainer_name(t) in members)
        consumers = tuple(c for c in self.consumers if consumer_name(c) in members)
        held = {t: self._held.get(t) for t in trainers}
        key = (trainers, consumers, tuple(sorted((t, None if h is None else tuple(sorted(h))) for t, h in held.items())))
        schedule_id = self._schedules.get(key)
        if schedule_id is None:
            schedule = build_schedule({c: self.layouts[c] for c in consumers}, self.groups, held, trainers, consumers)
            schedule_id = f"s{version}"
            self.control.set(f"schedule/{schedule_id}", schedule.to_json())
            self._schedules[key] = schedule_id
        excluded = tuple(n for n in self.names() if n not in members)
        self.control.set(_announce_key(version), json.dumps({"schedule": schedule_id, "members": members}))
        self.members, self.last_version = members, version
        return Announcement(version, schedule_id, members, excluded)


# ---- shared rank plumbing ----------------------------------------------------------------------------------------------------
class _Rank:
    name: str
    epoch: int

    def __init__(self, transport: Transport, control: Control, config: SyncConfig | None):
        self.transport, self.control = transport, control
        self.config = config or SyncConfig()
        self._schedules: dict[str, Schedule] = {}
        self._prepared: tuple | None = None   # what prepare(version) read, for sync(version)

    def _announcement(self, version: int) -> tuple[dict, Schedule]:
        ann = json.loads(self.control.get(_announce_key(version), self.config.announce_timeout_s, "coordinator",
                                          f"announcement of version {version}"))
        if ann["members"].get(self.name) != self.epoch:
            why = "failed or stalled in the last version" if self.name not in ann["members"] else "restarted"
            self._rejoin()
            raise NotAMember(f"{self.name} (epoch {self.epoch}) is not part of version {version} ({why}); "
                             f"it re-joined and takes part from the next announced version")
        sid = ann["schedule"]
        if sid not in self._schedules:
            self._schedules[sid] = Schedule.from_json(
                self.control.get(f"schedule/{sid}", self.config.timeout_s, "coordinator", "schedule"))
        return ann, self._schedules[sid]

    def _take_prepared(self, version: int) -> tuple:
        """What prepare(version) read (preparing now when it was not called for this version), used up by one sync."""
        if self._prepared is None or self._prepared[0] != version:
            self.prepare(version)
            _trace("prepared")
        prepared, self._prepared = self._prepared, None
        return prepared[1:]

    def _rejoin(self) -> None:
        self.epoch = _join(self.control, self.name, getattr(self, "held", None))

    def _finish(self, version: int, failures: dict[Peer, BaseException]) -> None:
        if failures:
            # a new epoch makes every adapter re-open its connections to this rank: nothing half-done is reused
            self.epoch = self.control.add(f"epoch/{self.name}", 1)
        self.control.set(_result_key(version, self.name), json.dumps(
            {"ok": not failures, "epoch": self.epoch,
             "errors": {p: f"{type(e).__name__}: {e}" for p, e in failures.items()}}))
        if failures:
            raise SyncFailed(self.name, version, failures)


class _GroupTensors:
    """The source's tensors of a group, fetched once per sync for all lanes (and all parts of a split group: the
    source knows decoder-layer groups, not parts), dropped when the last lane packed its last part."""

    def __init__(self, source: WeightSource, uses: Mapping[str, int]):
        from shardplan.replay import base_group
        self.base_group = base_group
        self.source, self.uses = source, {}
        for group, n in uses.items():
            self.uses[base_group(group)] = self.uses.get(base_group(group), 0) + n
        self.cache: dict[str, Mapping[str, torch.Tensor]] = {}
        self.lock = threading.Lock()

    def get(self, group: str) -> Mapping[str, torch.Tensor]:
        base = self.base_group(group)
        with self.lock:
            if base not in self.cache:
                self.cache[base] = self.source.group(base)
            return self.cache[base]

    def release(self, group: str) -> None:
        base = self.base_group(group)
        with self.lock:
            self.uses[base] -= 1
            if self.uses[base] == 0:
                self.cache.pop(base, None)


def _no_context():
    return contextlib.nullcontext()


def _aligned(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


# ---- trainer -----------------------------------------------------------------------------------------------------------------
class TrainerSync(_Rank):
    """One trainer rank. Staging: two slots per consumer, each the size of that consumer's largest group, allocated
    and registered once."""

    def __init__(self, rank: int, packer: Packer, source: WeightSource, transport: Transport, control: Control,
                 config: SyncConfig | None = None, device: torch.device | str = "cpu"):
        self.rank, self.name = rank, trainer_name(rank)
        self.packer, self.source = packer, source
        self.groups = tuple(packer.groups())
        self.consumers = tuple(packer.consumers())
        super().__init__(transport, control, config)
        sizes = {c: _aligned(max((max((s.offset + s.nbytes for s in packer.layout(c, g)), default=0)
                                  for g in self.groups), default=1)) for c in self.consumers}
        self.staging = {c: torch.zeros(2 * sizes[c], dtype=torch.uint8, device=device) for c in self.consumers}
        self.slots = {c: (buf[:sizes[c]], buf[sizes[c]:]) for c, buf in self.staging.items()}
        transport.register(list(self.staging.values()))
        control.prewarm(len(self.consumers) + 2)   # one per lane (or pair rendezvous), opened now rather than mid-sync
        needed = {n for c in self.consumers for g in self.groups for s in packer.layout(c, g) for n in s.sources}
        self.held = held_whole(source, needed)
        self._step_cache: dict[tuple[int, int], tuple[Schedule, list]] = {}
        self.epoch = _join(control, self.name, self.held)

    def prepare(self, version: int) -> None:
        """The control-plane part of syncing `version`, ahead of it (e.g. while the optimizer step runs): read the
        announcement and schedule, open connections to this version's consumers. sync(version) then starts packing
        and sending at once. Optional: sync() prepares itself when this was not called for its version."""
        ann, schedule = self._announcement(version)
        lanes = [c for c in schedule.consumers
                 if any(schedule.of(c, g, self.rank) for g in range(len(schedule.groups)))]
        self.transport.connect({self.name: self.epoch, **{consumer_name(c): ann["members"][consumer_name(c)]
                                                          for c in lanes}})
        uses = {g: sum(1 for c in lanes if schedule.of(c, gi, self.rank)) for gi, g in enumerate(schedule.groups)}
        self._prepared = (version, schedule, lanes, uses)

    def sync(self, version: int) -> SyncReport:
        start = time.monotonic()
        _trace("trainer sync")
        schedule, lanes, uses = self._take_prepared(version)
        tensors = _GroupTensors(self.source, uses)
        failures: dict[Peer, BaseException] = {}
        sent = {c: 0 for c in lanes}
        lane = self._lane if self.transport.one_sided else self._lane_two_sided
        # the first lane runs in this thread (no thread start before the first send), the others in threads
        threads = [threading.Thread(target=lane, args=(version, c, schedule, tensors, failures, sent),
                                    name=f"{self.name}->consumer{c}", daemon=True) for c in lanes[1:]]
        for t in threads:
            t.start()
        if lanes:
            device = self.slots[lanes[0]][0].device
            with torch.cuda.device(device) if device.type == "cuda" else _no_context():
                lane(version, lanes[0], schedule, tensors, failures, sent)
        for t in threads:
            t.join()   # every wait in a lane has a deadline; only this rank's own pack/source can stall it
        _trace("lanes joined")
        self._finish(version, failures)
        _trace("result set")
        return SyncReport(self.name, version, time.monotonic() - start, sum(sent.values()),
                          tuple(consumer_name(c) for c in lanes))

    def _lane(self, version: int, c: int, schedule: Schedule, tensors: _GroupTensors,
              failures: dict[Peer, BaseException], sent: dict[int, int]) -> None:
        peer = consumer_name(c)
        wait_s = 1.5 * self.config.timeout_s
        if self.slots[c][0].is_cuda:
            torch.cuda.set_device(self.slots[c][0].device)   # a new thread starts on GPU 0
        in_flight = None   # (group index, pendings, sums): the previous group, finished after the next one is sent
        steps = self._steps(schedule, c)
        done: set[int] = set()
        try:
            for k, (gi, group, pieces, segments) in enumerate(steps):
                slot = self.slots[c][k % 2]   # free: the group that used it (k-2) finished in the last iteration
                self.packer.pack(c, group, tensors.get(group), slot, segments)
                tensors.release(group)
                sums = [checksum(slot[p.lo:p.hi]) for p in pieces] if self.config.verify else []
                free = self.control.get(_free_key(version, peer, gi), wait_s, peer, f"receive slot for {group}")
                if not free.startswith("ok"):
                    raise PeerAborted(peer, free)
                if time.time() > float(free.split()[1]) + self.config.timeout_s:
                    # the consumer stopped waiting for this group: a late one-sided write could land in its next version
                    raise PeerAborted(peer, f"gave up on group {group} before this trainer could send it")
                pendings = [self.transport.send(peer, slot[p.lo:p.hi], Tag(version, gi, gi % 2, p.lo, p.hi - p.lo))
                            for p in pieces]
                if in_flight is not None:
                    self._mark_done(version, peer, in_flight, wait_s)
                    done.add(in_flight[0])
                in_flight = (gi, pendings, sums)
                sent[c] += sum(p.hi - p.lo for p in pieces)
            if in_flight is not None:
                self._mark_done(version, peer, in_flight, wait_s)
                done.add(in_flight[0])
        except BaseException as e:  # noqa: BLE001 - recorded and raised by sync() as SyncFailed
            failures[peer] = e
            self._abort_lane(version, peer, steps, done, e)

    def _abort_lane(self, version: int, peer: Peer, steps: list, done: set[int], error: BaseException) -> None:
        """Mark every group of a failed lane not yet marked done as aborted: the consumer ends now rather than time
        out on this trainer."""
        for gi, _, _, _ in steps:
            if gi not in done:
                self.control.set(_done_key(version, self.name, peer, gi), f"abort: {self.name} stopped: {error}")

    def _lane_two_sided(self, version: int, c: int, schedule: Schedule, tensors: _GroupTensors,
                        failures: dict[Peer, BaseException], sent: dict[int, int]) -> None:
        """A lane over a two-sided transport (NCCL, gloo): a send completes only into a receive the consumer posted,
        and the consumer posts the receive into a slot only after it applied what the slot held. So no "slot free"
        marks are needed, and the consumer learns arrival from its receive: the lane only waits for its own send of
        group k-2 before packing group k into the same slot, and on the GPU the send waits for the pack through stream
        order. Control-channel traffic per group: the "done" mark with checksums, only when verifying, and set after
        the next send is posted (off the transfer's critical path). The consumer's abort mark (its "free" key) is
        polled only while a send is waited for."""
        peer = consumer_name(c)
        wait_s = 1.5 * self.config.timeout_s
        if self.slots[c][0].is_cuda:
            torch.cuda.set_device(self.slots[c][0].device)   # a new thread starts on GPU 0
        steps = self._steps(schedule, c)
        done: set[int] = set()
        in_flight: list[tuple[int, list, list]] = []   # (group index, pendings, checksum tensors), oldest first

        def finish(entry) -> None:
            gi, pendings, _ = entry
            check = lambda: _abort_mark(self.control, _free_key(version, peer, gi))  # noqa: E731
            for pending in pendings:
                pending.wait(wait_s, check=check)

        def mark(entry) -> None:
            gi, _, sums = entry
            if self.config.verify:
                self.control.set(_done_key(version, self.name, peer, gi), json.dumps({"sums": [int(x) for x in sums]}))
            done.add(gi)

        try:
            for k, (gi, group, pieces, segments) in enumerate(steps):
                finished = None
                if len(in_flight) == 2:   # this group's slot is still being sent from (group k-2): wait for it
                    finished = in_flight.pop(0)
                    finish(finished)
                    _trace(f"sent {finished[0]}")
                slot = self.slots[c][k % 2]
                self.packer.pack(c, group, tensors.get(group), slot, segments)
                tensors.release(group)
                _trace(f"pack {gi} enqueued")
                sums = [checksum_tensor(slot[p.lo:p.hi]) for p in pieces] if self.config.verify else []
                pendings = [self.transport.send(peer, slot[p.lo:p.hi], Tag(version, gi, gi % 2, p.lo, p.hi - p.lo))
                            for p in pieces]
                _trace(f"send {gi} posted")
                in_flight.append((gi, pendings, sums))
                sent[c] += sum(p.hi - p.lo for p in pieces)
                if finished is not None:
                    mark(finished)
            while in_flight:
                finished = in_flight.pop(0)
                finish(finished)
                _trace(f"sent {finished[0]}")
                mark(finished)
        except BaseException as e:  # noqa: BLE001 - recorded and raised by sync() as SyncFailed
            failures[peer] = e
            self._abort_lane(version, peer, steps, done, e)

    def _steps(self, schedule: Schedule, c: int) -> list[tuple[int, str, tuple[Piece, ...], list[int]]]:
        """(group index, group, this trainer's pieces, their segments) per group of consumer c it serves: a pure
        function of the schedule, computed once per schedule (thousands of segments per group in a no-EP MoE)."""
        key = (id(schedule), c)
        if key not in self._step_cache:
            if len(self._step_cache) > 64:
                self._step_cache.clear()
            steps = []
            for gi, group in enumerate(schedule.groups):
                pieces = schedule.of(c, gi, self.rank)
                if pieces:
                    steps.append((gi, group, pieces, sorted({i for p in pieces for i in p.segments})))
            self._step_cache[key] = (schedule, steps)   # (the schedule kept alive: its id stays its own)
        return self._step_cache[key][1]

    def _mark_done(self, version: int, peer: Peer, in_flight, wait_s: float) -> None:
        gi, pendings, sums = in_flight
        for pending in pendings:
            pending.wait(wait_s)
        self.control.set(_done_key(version, self.name, peer, gi), json.dumps({"sums": sums}))


# ---- consumer ----------------------------------------------------------------------------------------------------------------
class ConsumerSync(_Rank):
    """One consumer (inference) rank: two receive buffers, each the size of its largest group, registered once."""

    def __init__(self, rank: int, unpacker: Unpacker, transport: Transport, control: Control,
                 config: SyncConfig | None = None, device: torch.device | str = "cpu", initial_version: int = 0):
        self.rank, self.name = rank, consumer_name(rank)
        self.unpacker = unpacker
        self.sizes = dict(unpacker.sizes())
        super().__init__(transport, control, config)
        size = _aligned(max(self.sizes.values(), default=1))
        self.buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2)]
        transport.register(self.buffers)
        control.prewarm(4)   # this rank's waits and its transport's pair rendezvous, opened now rather than mid-sync
        self._state = SyncState(initial_version, True)
        self.held = None
        self.epoch = _join(control, self.name)

    @property
    def state(self) -> SyncState:
        """(version of the weights held, whether every byte of that version arrived, verified, and was applied)."""
        return self._state

    def prepare(self, version: int) -> None:
        """The control-plane part of syncing `version`, ahead of it: read the announcement and schedule, check them
        against this rank's plan, open connections to this version's trainers (see TrainerSync.prepare)."""
        ann, schedule = self._announcement(version)
        c, groups = self.rank, schedule.groups
        for gi, group in enumerate(groups):
            if schedule.nbytes[c][gi] > self.sizes.get(group, 0):
                raise ScheduleError(f"{self.name}: the trainers' layout of {group} has {schedule.nbytes[c][gi]} bytes, "
                                    f"this rank's has {self.sizes.get(group, 0)}: the two sides use different plans (or a "
                                    f"different max_group_bytes)")
        trainers = sorted({p.trainer for gi in range(len(groups)) for p in schedule.of(c, gi)})
        self.transport.connect({self.name: self.epoch,
                                **{trainer_name(t): ann["members"][trainer_name(t)] for t in trainers}})
        self._prepared = (version, schedule, trainers)

    def sync(self, version: int) -> SyncReport:
        start = time.monotonic()
        _trace("consumer sync")
        schedule, trainers = self._take_prepared(version)
        if not self.transport.one_sided:
            return self._sync_two_sided(version, schedule, trainers, start)
        c, groups = self.rank, schedule.groups
        posted: dict[int, list] = {}
        received = 0
        failures: dict[Peer, BaseException] = {}

        def post(gi: int) -> None:
            posted[gi] = self._post_receives(version, schedule, gi)
            self.control.set(_free_key(version, self.name, gi), f"ok {time.time():.6f}")

        try:
            for gi in range(min(2, len(groups))):
                post(gi)
            for gi, group in enumerate(groups):
                buf, pieces = self.buffers[gi % 2], schedule.of(c, gi)
                deadline = deadline_after(self.config.timeout_s)
                seen: dict[int, int] = {}
                for piece, pending in zip(pieces, posted.pop(gi)):
                    peer = trainer_name(piece.trainer)
                    mark = self.control.get(_done_key(version, peer, self.name, gi), left(deadline), peer,
                                            f"bytes of {group}")
                    if mark.startswith("abort"):
                        raise PeerAborted(peer, mark)
                    pending.wait(max(left(deadline), 0.001))
                    j = seen[piece.trainer] = seen.get(piece.trainer, -1) + 1
                    if self.config.verify:
                        _check_sum(peer, mark, j, checksum(buf[piece.lo:piece.hi]), piece, group)
                    received += piece.hi - piece.lo
                self._apply(version, group, buf)
                if gi + 2 < len(groups):
                    post(gi + 2)
            self._state = SyncState(version, True)
        except BaseException as e:  # noqa: BLE001 - recorded and raised by _finish as SyncFailed
            failures[getattr(e, "peer", self.name)] = e
            for gi in range(len(groups)):   # trainers waiting for a free slot end now
                if self.control.try_get(_free_key(version, self.name, gi)) is None:
                    self.control.set(_free_key(version, self.name, gi), f"abort: {self.name} gave up: {e}")
        self._finish(version, failures)
        return SyncReport(self.name, version, time.monotonic() - start, received,
                          tuple(trainer_name(t) for t in trainers))

    def _post_receives(self, version: int, schedule: Schedule, gi: int) -> list:
        """Post the receives of group gi's pieces into its slot (gi % 2); one Pending per piece."""
        buf = self.buffers[gi % 2]
        return [self.transport.recv(trainer_name(p.trainer), buf[p.lo:p.hi],
                                    Tag(version, gi, gi % 2, p.lo, p.hi - p.lo)) for p in schedule.of(self.rank, gi)]

    def _apply(self, version: int, group: str, buf: torch.Tensor) -> None:
        if self.sizes.get(group, 0):
            if self._state != SyncState(version, False):
                self._state = SyncState(version, False)   # params now hold a mix of two versions
            self.unpacker.apply(group, buf[:self.sizes[group]])

    def _sync_two_sided(self, version: int, schedule: Schedule, trainers: list[int], start: float) -> SyncReport:
        """The consumer over a two-sided transport (see TrainerSync._lane_two_sided): post the receives of groups 0
        and 1; per group, wait for its receives (polling the trainers' abort marks only while waiting), checksum on
        the device (enqueued), apply, and post the receive of group k+2 into the freed slot (on the GPU it waits for
        the apply through stream order). The trainers' checksums are read once, at the end, before the version is
        committed: no control-channel round trip sits between two transfers."""
        c, groups = self.rank, schedule.groups
        posted: dict[int, list] = {}
        sums: list[tuple[int, int, Piece, torch.Tensor]] = []   # (group index, index among its trainer's pieces, ...)
        received = 0
        failures: dict[Peer, BaseException] = {}

        def post(gi: int) -> None:
            posted[gi] = self._post_receives(version, schedule, gi)

        try:
            for gi in range(min(2, len(groups))):
                post(gi)
            _trace("first receives posted")
            for gi, group in enumerate(groups):
                buf, pieces = self.buffers[gi % 2], schedule.of(c, gi)
                deadline = deadline_after(self.config.timeout_s)
                seen: dict[int, int] = {}
                for piece, pending in zip(pieces, posted.pop(gi)):
                    peer = trainer_name(piece.trainer)
                    key = _done_key(version, peer, self.name, gi)
                    pending.wait(max(left(deadline), 0.001), check=lambda: _abort_mark(self.control, key))
                    _trace(f"received {gi}")
                    j = seen[piece.trainer] = seen.get(piece.trainer, -1) + 1
                    if self.config.verify:
                        sums.append((gi, j, piece, checksum_tensor(buf[piece.lo:piece.hi])))
                    received += piece.hi - piece.lo
                self._apply(version, group, buf)
                _trace(f"apply {gi} enqueued")
                if gi + 2 < len(groups):
                    post(gi + 2)
                    _trace(f"receive {gi + 2} posted")
            deadline = deadline_after(self.config.timeout_s)
            for gi, j, piece, got in sums:
                peer = trainer_name(piece.trainer)
                mark = self.control.get(_done_key(version, peer, self.name, gi), left(deadline), peer,
                                        f"checksums of {groups[gi]}")
                if mark.startswith("abort"):
                    raise PeerAborted(peer, mark)
                _check_sum(peer, mark, j, int(got), piece, groups[gi])
            self._state = SyncState(version, True)
        except BaseException as e:  # noqa: BLE001 - recorded and raised by _finish as SyncFailed
            failures[getattr(e, "peer", self.name)] = e
            for gi in range(len(groups)):   # trainers waiting on a send to this rank end now
                self.control.set(_free_key(version, self.name, gi), f"abort: {self.name} gave up: {e}")
        _trace("committed")
        self._finish(version, failures)
        _trace("result set")
        return SyncReport(self.name, version, time.monotonic() - start, received,
                          tuple(trainer_name(t) for t in trainers))


def _check_sum(peer: Peer, mark: str, j: int, got: int, piece: Piece, group: str) -> None:
    """Compare the consumer's checksum of a piece with the one its trainer wrote in its "done" mark (j-th of its
    pieces in the group)."""
    expected = json.loads(mark)["sums"][j]
    if expected != got:
        raise ChecksumMismatch(peer, f"bytes [{piece.lo}, {piece.hi}) of {group}: checksum {got}, "
                                     f"trainer packed {expected}")


def _abort_mark(control: Control, key: str) -> str | None:
    """The abort message a peer left at `key`, if any (None while the key is unset or holds a normal mark)."""
    value = control.try_get(key)
    return value if value is not None and value.startswith("abort") else None


# ---- adapters to the other stages: replay (trainer), apply (consumer), shards (sharded trainers) ---------------------------
# Pipeline unit of ReplayPacker / ApplyUnpacker: a decoder layer's group larger than this is moved in parts (see
# PackLayout.from_plans). The sync's fill (pack the first part) and drain (apply the last) are one part each: on an
# H200 pair a 256 MiB part is ~0.7 ms on the wire and ~0.1 ms to pack or apply. Trainer and consumer must agree.
PART_BYTES = 256 << 20


def layouts_of(packer: Packer) -> dict[int, dict[str, tuple[Segment, ...]]]:
    """What the Coordinator needs: every consumer's segments per group."""
    return {c: {g: tuple(packer.layout(c, g)) for g in packer.groups()} for c in packer.consumers()}


def _segment_sources(replayer, seg) -> tuple[str, ...]:
    from shardplan import ir
    names: set[str] = set()
    plan = next(p for p in replayer.plans if p.rank == seg.refs[0].rank)
    ir._collect_sources(plan.writes[seg.refs[0].index].src.leaf, names)
    return tuple(sorted(names))


def _ordered_groups(layouts) -> tuple[str, ...]:
    from shardplan.replay import group_order
    return tuple(sorted({g for lay in layouts for g in lay.group_names}, key=group_order))


class _Packs:
    """Bound replays per (key, segment subset, output buffer, tensors): built on first use, reused every sync."""

    def __init__(self):
        self.bound: dict[tuple, object] = {}

    def run(self, key, replayer, segments: Sequence[int], tensors: Mapping[str, torch.Tensor], out: torch.Tensor):
        # the common case (one trainer serves the whole group) keyed without hashing every segment index
        whole = len(segments) == len(replayer.layout.segments)
        sub_key = (key, "all") if whole else (key, tuple(segments))
        if sub_key not in self.bound or self.bound[sub_key][0] is not replayer:
            self.bound[sub_key] = (replayer, replayer if whole else replayer.subset(segments), {})
        _, sub, by_buffer = self.bound[sub_key]
        from shardplan.replay import StaleBindingError
        bound = by_buffer.get(out.data_ptr())
        if bound is not None:
            try:
                bound.pack(check=True)   # check(): the trainer's tensors still have the storage bound to
                return
            except StaleBindingError:
                pass
        if len(by_buffer) >= 4 and out.data_ptr() not in by_buffer:
            by_buffer.pop(next(iter(by_buffer)))
        names = sub.sources_read()
        by_buffer[out.data_ptr()] = sub.bind({n: tensors[n] for n in names}, out[:sub.layout.nbytes])
        by_buffer[out.data_ptr()].pack(check=False)


@dataclass(frozen=True, slots=True)
class FallbackSlot:
    """A fallback tensor (its loader could not be recorded) shipped whole: `nbytes` at byte `offset` of its group's
    buffer, after the group's replayed bytes. The consumer hands it to the real loader."""
    name: str
    offset: int
    nbytes: int


def fallback_slots(plan, layout, sources: Mapping[str, TensorMeta]) -> dict[str, tuple[FallbackSlot, ...]]:
    """Where each of the plan's fallback tensors travels: appended (aligned) to the last part of its decoder layer's
    group in `layout` (so the trainer's source serves it with its layer), or a group of its own when no write of the
    plan is in that layer. Trainer and consumer compute it from the same plan, layout and sources."""
    from shardplan import ir
    from shardplan.replay import _itemsize, base_group, to_dtype
    last_part: dict[str, str] = {}
    ends = {g.name: g.nbytes for g in layout.groups}
    for g in layout.groups:
        last_part[base_group(g.name)] = g.name   # groups are in order: the last part wins
    out: dict[str, list[FallbackSlot]] = {}
    for f in sorted(plan.fallbacks, key=lambda f: f.source):
        meta = sources.get(f.source)
        if meta is None:
            raise ShardplanError(f"consumer rank {plan.rank}: fallback tensor {f.source!r} is not in the sources "
                                 f"table, so it cannot be shipped; pass the plan file's sources")
        group = last_part.get(ir.group_of(f.source), ir.group_of(f.source))
        offset = _aligned(ends.get(group, 0), layout.alignment)
        nbytes = meta.numel * _itemsize(to_dtype(meta.dtype))
        out.setdefault(group, []).append(FallbackSlot(f.source, offset, nbytes))
        ends[group] = offset + nbytes
    return {g: tuple(slots) for g, slots in out.items()}


class ReplayPacker:
    """Packer over shardplan.replay for trainers that hold checkpoint tensors whole (replicated, or gathered per
    group by the WeightSource): one Replayer per consumer plan; any trainer holding a segment's sources may serve it.
    Fallback tensors of a plan travel whole, after their layer's replayed bytes (`fallback_slots`)."""

    def __init__(self, plans, sources: Mapping[str, TensorMeta], *, alignment: int = 256,
                 device: torch.device | str | None = None, max_group_bytes: int | None = PART_BYTES):
        from shardplan.replay import Replayer, group_order
        self.sources = dict(sources)
        self.replayers = {p.rank: Replayer(p, sources, alignment=alignment, device=device,
                                           max_group_bytes=max_group_bytes) for p in plans}
        self.fallbacks = {p.rank: fallback_slots(p, self.replayers[p.rank].layout, self.sources) for p in plans}
        groups = set(_ordered_groups(r.layout for r in self.replayers.values()))
        groups.update(g for slots in self.fallbacks.values() for g in slots)
        self._groups = tuple(sorted(groups, key=group_order))
        self._packs = _Packs()

    def consumers(self):
        return sorted(self.replayers)

    def groups(self):
        return self._groups

    def layout(self, consumer: int, group: str):
        rep = self.replayers[consumer]
        out = []
        if group in rep.layout.group_names:
            rep_g = rep.for_group(group)
            out = [Segment(s.offset, s.nbytes, _segment_sources(rep_g, s)) for s in rep_g.layout.segments]
        out += [Segment(f.offset, f.nbytes, (f.name,)) for f in self.fallbacks[consumer].get(group, ())]
        return tuple(out)

    def pack(self, consumer, group, tensors, out, segments):
        from shardplan.replay import check_tensor
        rep = self.replayers[consumer]
        num_replayed = len(rep.for_group(group).layout.segments) if group in rep.layout.group_names else 0
        replayed = [i for i in segments if i < num_replayed]
        if replayed:
            self._packs.run((consumer, group), rep.for_group(group), replayed, tensors, out)
        slots = self.fallbacks[consumer].get(group, ())
        for i in segments:
            if i >= num_replayed:   # a fallback tensor, whole, as bytes
                f = slots[i - num_replayed]
                t = tensors.get(f.name)
                check_tensor("trainer tensor", f.name, t, self.sources[f.name], out.device)
                out[f.offset:f.offset + f.nbytes].copy_(t.reshape(-1).view(torch.uint8))


class ApplyUnpacker:
    """Unpacker over shardplan.apply: the consumer's own plan, its layout, its live params. A plan with fallbacks
    needs `sources` (the plan file's table) and `fallback_loader(name, tensor)`, typically the real vLLM loader:
    `lambda name, t: model.load_weights([(name, t)])`; it gets each fallback tensor whole (a copy it may keep) once
    its group arrived."""

    def __init__(self, plan, params: Mapping[str, torch.Tensor], *, alignment: int = 256,
                 max_group_bytes: int | None = PART_BYTES, sources: Mapping[str, TensorMeta] | None = None,
                 fallback_loader=None):
        from shardplan.apply import Applier
        from shardplan.replay import PackLayout
        self.layout = PackLayout.from_plans(plan, alignment, max_group_bytes)
        self.fallbacks: dict[str, tuple[FallbackSlot, ...]] = {}
        if plan.fallbacks:
            if sources is None or fallback_loader is None:
                raise ShardplanError(f"consumer rank {plan.rank}: its plan has {len(plan.fallbacks)} fallback tensors "
                                     f"({plan.fallbacks[0].source}, ...): pass sources= (the plan file's table) and "
                                     f"fallback_loader= (the real loader, which gets each of them whole)")
            self.fallbacks = fallback_slots(plan, self.layout, sources)
        self.applier = Applier(plan, self.layout, params, fallback_loader=fallback_loader)
        self.sources, self.fallback_loader = sources, fallback_loader

    def sizes(self):
        sizes = {g.name: g.nbytes for g in self.layout.groups}
        for group, slots in self.fallbacks.items():
            sizes[group] = slots[-1].offset + slots[-1].nbytes
        return sizes

    def apply(self, group, buffer):
        from shardplan.replay import to_dtype
        if group in self.layout.group_names:
            self.applier.apply_group(group, buffer[:self.layout.group(group).nbytes])
        for f in self.fallbacks.get(group, ()):
            meta = self.sources[f.name]
            tensor = buffer[f.offset:f.offset + f.nbytes].view(to_dtype(meta.dtype)).view(meta.shape).clone()
            self.fallback_loader(f.name, tensor)


def _sharded_layouts(sharded, consumer: int, alignment: int):
    """Per trainer rank: the (trainer, consumer) sub-plan's layout; the consumer's group buffer is their
    concatenation in trainer order, each part aligned (so every part is a buffer of its own for Applier/Replayer)."""
    from shardplan.replay import PackLayout
    parts = {t: PackLayout.from_plans(p, alignment) for t, p in sharded.for_consumer(consumer).items()}
    return parts


def _sharded_bases(parts, group: str, alignment: int) -> dict[int, int]:
    bases, offset = {}, 0
    for t, lay in sorted(parts.items()):
        if group in lay.group_names:
            bases[t] = offset
            offset = _aligned(offset + lay.group(group).nbytes, alignment)
    return bases


class ShardedPacker:
    """Packer for sharded trainers (shardplan.shards.ShardedPlan): trainer `rank` packs, for each consumer, the
    pieces plan_shards gave it, from its local shards; each piece can come from that trainer only."""

    def __init__(self, sharded, rank: int, *, alignment: int = 256, device: torch.device | str | None = None):
        from shardplan.replay import Replayer
        self.sharded, self.rank, self.alignment = sharded, rank, alignment
        self.consumer_ranks = sorted({c for _, c in sharded.plans})
        self.parts = {c: _sharded_layouts(sharded, c, alignment) for c in self.consumer_ranks}
        self._groups = _ordered_groups(lay for parts in self.parts.values() for lay in parts.values())
        mine = {c: p for (t, c), p in sharded.plans.items() if t == rank}
        self.replayers = {c: Replayer(p, sharded.sources[rank], alignment=alignment, device=device)
                          for c, p in mine.items()}
        self._packs = _Packs()

    def consumers(self):
        return self.consumer_ranks

    def groups(self):
        return self._groups

    def layout(self, consumer: int, group: str):
        parts, out = self.parts[consumer], []
        for t, base in _sharded_bases(parts, group, self.alignment).items():
            out += [Segment(base + s.offset, s.nbytes, (), (t,)) for s in parts[t].group(group).segments]
        return tuple(out)

    def pack(self, consumer, group, tensors, out, segments):
        base = _sharded_bases(self.parts[consumer], group, self.alignment)[self.rank]
        rep_g = self.replayers[consumer].for_group(group)
        first = sum(len(self.parts[consumer][t].group(group).segments)
                    for t in sorted(self.parts[consumer]) if t < self.rank and group in self.parts[consumer][t].group_names)
        mine = [i - first for i in segments]
        self._packs.run((consumer, group), rep_g, mine, tensors, out[base:base + rep_g.layout.nbytes])


class ShardedUnpacker:
    """Unpacker for a consumer fed by sharded trainers: one Applier per trainer part of each group."""

    def __init__(self, sharded, consumer: int, params: Mapping[str, torch.Tensor], *, alignment: int = 256):
        from shardplan.apply import Applier
        self.alignment = alignment
        self.parts = _sharded_layouts(sharded, consumer, alignment)
        plans = sharded.for_consumer(consumer)
        self.appliers = {t: Applier(plans[t], lay, params) for t, lay in self.parts.items()}
        groups = {g for lay in self.parts.values() for g in lay.group_names}
        self._sizes = {}
        for g in groups:
            bases = _sharded_bases(self.parts, g, alignment)
            last = max(bases, key=bases.get)
            self._sizes[g] = bases[last] + self.parts[last].group(g).nbytes

    def sizes(self):
        return dict(self._sizes)

    def apply(self, group, buffer):
        for t, base in _sharded_bases(self.parts, group, self.alignment).items():
            n = self.parts[t].group(group).nbytes
            self.appliers[t].apply_group(group, buffer[base:base + n])
