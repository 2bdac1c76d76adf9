"""The coordinator: decides, per version, who takes part, and publishes the schedule (runs in the driver)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from shardplan.sync.control import announce_key, result_key, version_keys
from shardplan.sync.schedule import KEPT_SCHEDULES, Schedule, build_schedule
from shardplan.sync.stages import ScheduleError, Span, SyncConfig
from shardplan.transport.base import Control, PeerError, consumer_name, deadline_after, left, trainer_name


@dataclass
class Announcement:
    version: int
    schedule_id: str
    members: dict[str, int]  # rank name -> epoch
    excluded: tuple[str, ...] = ()


class Coordinator:
    """Decides, per version, who takes part, and publishes the schedule. Runs in the driver (or the launcher).

    `spans[c][group]`: consumer c's spans per group (what the trainers' Packer reports; `spans_of(packer)`).
    `eplb`: an EPLB plan's SlotSpans (sync.placement.slot_spans(packer)): where some trainer holds only some of the
    experts, each version is scheduled for the placements its consumers published (`v<V>/placement/<consumer>`,
    which must then be set before the announcement: announce() waits for them, at most timeout_s)."""

    def __init__(
        self,
        control: Control,
        spans: Mapping[int, Mapping[str, Sequence[Span]]],
        groups: Sequence[str],
        num_trainers: int,
        config: SyncConfig | None = None,
        *,
        eplb=None,
    ):
        self.control, self.spans, self.groups, self.eplb = control, spans, tuple(groups), eplb
        self.trainers, self.consumers = tuple(range(num_trainers)), tuple(sorted(spans))
        self.config = config or SyncConfig()
        self.members: dict[str, int] = {}
        self.last_version: int | None = None
        self._schedules: dict[tuple, str] = {}
        self._parsed: dict[str, Schedule] = {}  # schedule id -> the schedule (for the keys its versions leave)
        self._announced: dict[int, tuple[tuple[str, ...], str]] = {}  # version -> (members, schedule id)
        self._forgetting: threading.Thread | None = None
        self._held: dict[int, frozenset[str] | None] = {}
        self._known: dict[str, int] = {}  # highest epoch seen per rank
        self._stamps: dict[str, dict[str, str]] = {}  # rank -> its stamps of consumers' bytes (see control.join)

    def names(self) -> list[str]:
        return [trainer_name(t) for t in self.trainers] + [consumer_name(c) for c in self.consumers]

    def results(self, version: int, timeout_s: float) -> dict[str, dict]:
        """Results of `version` from its members, waiting at most `timeout_s` in all; missing ranks are left out.
        Results already there are read first, and again after the waits: a dead rank's wait uses up the deadline, and
        a live rank read after it with the ~0 s left could time out on a loaded box and be dropped (it then missed
        the next version: the engine's repair sync after a killed trainer failed that way)."""
        out, deadline = {}, deadline_after(timeout_s)
        for attempt in ("present", "wait", "present"):
            for name in self.members:
                if name in out:
                    continue
                try:
                    text = (
                        self.control.try_get(result_key(version, name))
                        if attempt == "present"
                        else self.control.get(result_key(version, name), left(deadline), name, "result")
                    )
                except PeerError:
                    continue
                if text is not None:
                    out[name] = json.loads(text)
        return out

    def announce(self, version: int, wait_for_joins_s: float | None = None, *, waiting: bool = False) -> Announcement:
        """Announce `version`: members are the ranks that reported a result for the last version (with the epoch they
        reported), plus ranks that (re-)joined since; ranks silent since the last version are excluded. `waiting`:
        the ranks already wait for this announcement (an EPLB plan's, announced beside the engines' updates), so a
        version no schedule can serve (ScheduleError) is announced to them as refused before the error is raised."""
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
                    self._stamps[name] = record.get("stamps", {})
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
        placements, placed = None, ()
        if self.eplb is not None and self.eplb.placement_matters(held):
            placements = self.eplb.placements(self.control, version, consumers, self.config.timeout_s)
            placed = tuple(placements[c].digest for c in consumers)
        key = (
            trainers,
            consumers,
            tuple(sorted((t, None if h is None else tuple(sorted(h))) for t, h in held.items())),
            placed,
        )
        schedule_id = self._schedules.pop(key, None)
        if schedule_id is not None:
            self._schedules[key] = schedule_id  # the most recently used last: evicted last
        else:
            spans = {c: self.spans[c] if placements is None else self.eplb.bound(c, placements[c]) for c in consumers}
            try:
                schedule = build_schedule(spans, self.groups, held, trainers, consumers)
            except ScheduleError as e:
                if waiting:  # the ranks end now, told why, and leave results that the next version reads
                    self.control.set(announce_key(version), json.dumps({"refused": str(e)}))
                    self.members, self.last_version = members, version
                raise
            schedule_id = f"s{version}"
            self.control.set(f"schedule/{schedule_id}", schedule.to_json())
            self._schedules[key], self._parsed[schedule_id] = schedule_id, schedule
            while len(self._schedules) > KEPT_SCHEDULES:  # EPLB: one per set of placements; each MiBs in the store
                self.control.delete(f"schedule/{self._schedules.pop(next(iter(self._schedules)))}")
        excluded = tuple(n for n in self.names() if n not in members)
        # every member's stamps travel with the announcement: each rank compares its own with its peers' before
        # any byte moves (Rank._mismatches)
        stamps = {name: self._stamps.get(name, {}) for name in members}
        self.control.set(
            announce_key(version), json.dumps({"schedule": schedule_id, "members": members, "stamps": stamps})
        )
        self.members, self.last_version = members, version
        self._announced[version] = (tuple(members), schedule_id)
        self._forget(version)
        return Announcement(version, schedule_id, members, excluded)

    def _forget(self, version: int) -> None:
        """Delete, in a thread, the keys of versions before the last one (every rank is done with them: announcing
        `version` waited for the last one's results), so a long job's store does not grow by every version."""
        jobs = [
            (v, members, self._parsed[sid])
            for v, (members, sid) in sorted(self._announced.items())
            if v < version - 1 and sid in self._parsed
        ]
        for v in [v for v in self._announced if v < version - 1]:
            del self._announced[v]
        live = {sid for _, sid in self._announced.values()} | set(self._schedules.values())
        self._parsed = {sid: s for sid, s in self._parsed.items() if sid in live}
        if not jobs:
            return
        before = self._forgetting

        def run():
            if before is not None:
                before.join()
            try:
                for v, members, schedule in jobs:
                    for key in version_keys(v, members, schedule):
                        self.control.delete(key)
            except Exception:  # noqa: BLE001 - the store is gone (the driver is closing): nothing left to keep small
                pass

        self._forgetting = threading.Thread(target=run, daemon=True, name="forget old versions")
        self._forgetting.start()
