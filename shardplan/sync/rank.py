"""What trainer and consumer ranks share: announcement and schedule reading, prepare/sync hand-over, rejoining,
and writing the result of a version."""

from __future__ import annotations

import json
import threading
from typing import Mapping

import torch

from shardplan.plan.names import base_group
from shardplan.sync.control import PROTOCOL, announce_key, join, result_key, stamp_protocol, wire_stamp
from shardplan.sync.schedule import CHECKSUM, KEPT_SCHEDULES, Schedule
from shardplan.sync.stages import LayoutMismatch, NotAMember, ScheduleError, SyncConfig, SyncFailed, WeightSource, event
from shardplan.transport.base import Control, Peer, Transport


class Rank:
    """Base of TrainerSync and ConsumerSync."""

    name: str
    epoch: int
    held: frozenset[str] | None = None  # a trainer's whole tensors, published when it (re-)joins; None: all it needs
    stamps: dict[int, str]  # consumer rank -> stamp of its bytes as this rank arranges them

    def __init__(self, transport: Transport, control: Control, config: SyncConfig | None):
        self.transport, self.control = transport, control
        self.config = config or SyncConfig()
        self._schedules: dict[str, Schedule] = {}
        self._prepared: tuple | None = None  # what prepare(version) read, for sync(version)

    def _announcement(self, version: int) -> tuple[dict, Schedule]:
        ann = json.loads(
            self.control.get(
                announce_key(version),
                self.config.announce_timeout_s,
                "coordinator",
                f"announcement of version {version}",
            )
        )
        if "refused" in ann:  # the result keeps this rank a member of the next version
            refused = ScheduleError(f"version {version} has no schedule: {ann['refused']}")
            self._finish(version, {"coordinator": refused})
        if ann["members"].get(self.name) != self.epoch:
            why = "failed or stalled in the last version" if self.name not in ann["members"] else "restarted"
            self._rejoin()
            raise NotAMember(
                f"{self.name} (epoch {self.epoch}) is not part of version {version} ({why}); "
                f"it re-joined and takes part from the next announced version"
            )
        sid = ann["schedule"]
        if sid not in self._schedules:
            while len(self._schedules) >= KEPT_SCHEDULES:  # per placement with EPLB: keep the recent ones
                self._schedules.pop(next(iter(self._schedules)))
            self._schedules[sid] = Schedule.from_json(
                self.control.get(f"schedule/{sid}", self.config.timeout_s, "coordinator", "schedule")
            )
        return ann, self._schedules[sid]

    def _mismatches(self, ann: dict, pairs: list[tuple[str, int]]) -> dict[Peer, LayoutMismatch]:
        """For each (peer, consumer rank) pair: the peer's stamp of that consumer's bytes against this rank's; a
        difference means the two sides would write bytes where the other does not read them."""
        out = {}
        for peer, c in pairs:
            mine, theirs = self.stamps.get(c), ann.get("stamps", {}).get(peer, {}).get(str(c))
            mine = None if mine is None else wire_stamp(mine)
            if theirs is not None and stamp_protocol(theirs) != PROTOCOL:
                out[peer] = LayoutMismatch(
                    peer,
                    f"{peer} speaks sync protocol {stamp_protocol(theirs)} and {self.name} protocol {PROTOCOL} "
                    f"({CHECKSUM} checksum): trainer ranks and engine run different shardplan versions, whose "
                    f"checksums would not agree; run the same version on both sides; nothing was sent",
                )
            elif mine != theirs and (mine is None or theirs is None):
                out[peer] = LayoutMismatch(
                    peer,
                    f"{self.name if mine is None else peer} packs or applies no bytes for consumer {c}: the two "
                    f"sides were built for different consumer sets (trainer ranks and the driver must be given the "
                    f"same plan and the same number of engine replicas, e.g. EngineSync(replicas=N) and "
                    f"TrainerRank(replicas=N)); nothing was sent",
                )
            elif mine != theirs:
                out[peer] = LayoutMismatch(
                    peer,
                    f"consumer {c}'s bytes are arranged as {theirs} by {peer} and as "
                    f"{mine} by {self.name} (plan rank:pack-layout digest): the two sides "
                    f"use different plans, a wrong rank mapping or another "
                    f"max_group_bytes; nothing was sent",
                )
        return out

    def _take_prepared(self, version: int) -> tuple:
        """What prepare(version) read (preparing now when it was not called for this version), used up by one sync."""
        if self._prepared is None or self._prepared[0] != version:
            self.prepare(version)
            event("prepared")
        prepared, self._prepared = self._prepared, None
        return prepared[1:]

    def _rejoin(self) -> None:
        self.epoch = join(self.control, self.name, self.held, self.stamps)

    def _finish(self, version: int, failures: dict[Peer, BaseException]) -> None:
        if failures:
            # a new epoch makes every adapter re-open its connections to this rank: nothing half-done is reused
            self.epoch = self.control.add(f"epoch/{self.name}", 1)
        self.control.set(
            result_key(version, self.name),
            json.dumps(
                {
                    "ok": not failures,
                    "epoch": self.epoch,
                    "errors": {p: f"{type(e).__name__}: {e}" for p, e in failures.items()},
                }
            ),
        )
        if failures:
            raise SyncFailed(self.name, version, failures)


class GroupTensors:
    """The source's tensors of a group, fetched once per sync for all lanes (and all parts of a split group: the
    source knows decoder-layer groups, not parts), dropped when the last lane packed its last part. `stage`: the
    packer's (ShardedPacker.stage: weights whose boxes cut quantization blocks, staged once for every lane); `ready`:
    called with the group before it is fetched, outside the lock (the sync's amax exchange: wait for that group's)."""

    def __init__(self, source: WeightSource, uses: Mapping[str, int], stage=None):
        self.source, self.uses, self.stage, self.ready = source, {}, stage, None
        for group, n in uses.items():
            self.uses[base_group(group)] = self.uses.get(base_group(group), 0) + n
        self.cache: dict[str, Mapping[str, torch.Tensor]] = {}
        self.lock = threading.Lock()

    def get(self, group: str) -> Mapping[str, torch.Tensor]:
        base = base_group(group)
        if self.ready is not None:
            self.ready(base)
        with self.lock:
            if base not in self.cache:
                tensors = self.source.group(base)
                self.cache[base] = tensors if self.stage is None else self.stage(base, tensors)
            return self.cache[base]

    def release(self, group: str) -> None:
        base = base_group(group)
        with self.lock:
            self.uses[base] -= 1
            if self.uses[base] == 0:
                self.cache.pop(base, None)
