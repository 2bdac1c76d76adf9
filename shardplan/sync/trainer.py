"""A trainer rank of the sync: one lane (thread) per consumer it serves, packing groups into two staging slots."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import torch

from shardplan.runtime.shards import AmaxExchangeError
from shardplan.runtime.tensors import align_up
from shardplan.sync.control import abort_mark, amax_key, decode_amaxes, done_key, encode_amaxes, free_key, join
from shardplan.sync.placement import any_expert, record_bound
from shardplan.sync.rank import GroupTensors, Rank
from shardplan.sync.schedule import Piece, Schedule, checksum_tensor, held_whole
from shardplan.sync.stages import Packer, SyncConfig, SyncReport, WeightSource, event
from shardplan.transport.base import (
    Control,
    Peer,
    PeerAborted,
    PeerError,
    Tag,
    Transport,
    consumer_name,
    trainer_name,
)


class TrainerSync(Rank):
    """One trainer rank. Staging: two slots per consumer, each the size of that consumer's largest group, allocated
    and registered once."""

    def __init__(
        self,
        rank: int,
        packer: Packer,
        source: WeightSource,
        transport: Transport,
        control: Control,
        config: SyncConfig | None = None,
        device: torch.device | str = "cpu",
    ):
        self.rank, self.name = rank, trainer_name(rank)
        self.packer, self.source = packer, source
        self.groups = tuple(packer.groups())
        self.consumers = tuple(packer.consumers())
        super().__init__(transport, control, config)
        sizes = {
            c: align_up(
                max(
                    (max((s.offset + s.nbytes for s in packer.spans(c, g)), default=0) for g in self.groups), default=1
                ),
                256,
            )
            for c in self.consumers
        }
        self.staging = {c: torch.zeros(2 * sizes[c], dtype=torch.uint8, device=device) for c in self.consumers}
        self.slots = {c: (buf[: sizes[c]], buf[sizes[c] :]) for c, buf in self.staging.items()}
        transport.register(list(self.staging.values()))
        control.prewarm(len(self.consumers) + 2)  # one per lane (or pair rendezvous), opened now rather than mid-sync
        needed = {n for c in self.consumers for g in self.groups for s in packer.spans(c, g) for n in s.sources}
        slots = getattr(packer, "slots", None)
        if slots is not None:  # EPLB: any expert may fill a slot: say which of them this rank holds (Coordinator)
            needed |= any_expert(needed, slots)
        self.held = held_whole(source, needed)
        self.stamps = {c: packer.stamp(c) for c in self.consumers}
        self._steps_of: tuple[Schedule | None, dict[int, list]] = (None, {})
        self.epoch = join(control, self.name, self.held, self.stamps)

    def prepare(self, version: int) -> None:
        """The control-plane part of syncing `version`, ahead of it (e.g. while the optimizer step runs): read the
        announcement and schedule, open connections to this version's consumers. sync(version) then starts packing
        and sending at once. Optional: sync() prepares itself when this was not called for its version."""
        ann, schedule = self._announcement(version)
        lanes = [
            c for c in schedule.consumers if any(schedule.of(c, g, self.rank) for g in range(len(schedule.groups)))
        ]
        self.transport.connect(
            {self.name: self.epoch, **{consumer_name(c): ann["members"][consumer_name(c)] for c in lanes}}
        )
        mismatched = self._mismatches(ann, [(consumer_name(c), c) for c in lanes])
        lanes = [c for c in lanes if consumer_name(c) not in mismatched]
        uses = {g: sum(1 for c in lanes if schedule.of(c, gi, self.rank)) for gi, g in enumerate(schedule.groups)}
        self._prepared = (version, schedule, lanes, uses, mismatched)

    def sync(self, version: int) -> SyncReport:
        start = time.monotonic()
        event("trainer sync")
        schedule, lanes, uses, mismatched = self._take_prepared(version)
        failures: dict[Peer, BaseException] = dict(mismatched)
        for peer, error in mismatched.items():  # the consumer ends at once instead of waiting for its bytes
            self._abort(version, peer, [gi for gi, *_ in self._steps(schedule, int(peer[8:]))], error)
        tensors = GroupTensors(self.source, uses, getattr(self.packer, "stage", None))
        exchange = _AmaxExchange(self, version, tensors)
        sent = {c: 0 for c in lanes}
        self._direct_sent = {c: 0 for c in lanes}
        lane = self._lane
        # the first lane runs in this thread (no thread start before the first send), the others in threads
        threads = [
            threading.Thread(
                target=lane,
                args=(version, c, schedule, tensors, failures, sent),
                name=f"{self.name}->consumer{c}",
                daemon=True,
            )
            for c in lanes[1:]
        ]
        for t in threads:
            t.start()
        if lanes:
            device = self.slots[lanes[0]][0].device
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                lane(version, lanes[0], schedule, tensors, failures, sent)
        for t in threads:
            t.join()  # every wait in a lane has a deadline; only this rank's own pack/source can stall it
        event("lanes joined")
        error = exchange.join()  # its peers need this rank's partials even where no lane of it is left
        if error is not None:
            failures[error.peer if isinstance(error, PeerError) else self.name] = error
        self._finish(version, failures)
        event("result set")
        return SyncReport(
            self.name,
            version,
            time.monotonic() - start,
            sum(sent.values()),
            tuple(consumer_name(c) for c in lanes),
            sum(self._direct_sent.values()),
        )

    def _lane(
        self,
        version: int,
        c: int,
        schedule: Schedule,
        tensors: GroupTensors,
        failures: dict[Peer, BaseException],
        sent: dict[int, int],
    ) -> None:
        """One consumer's groups, in order: pack group k into slot k % 2, send it, and mark groups done, with at most
        two groups in flight. How the consumer learns that bytes arrived is the transport's (the policy below):

        * two-sided (NCCL, gloo): a send completes only into a receive the consumer posted, and the consumer posts a
          receive into a slot only after it applied what the slot held. So no "slot free" marks are needed: the lane
          waits only for its own send of group k-2 before packing group k into the same slot (on the GPU the send
          waits for the pack through stream order), and sets a group's "done" mark (its checksums) only when
          verifying, after the next send is posted, off the transfer's critical path. The consumer's abort mark
          (its "free" key) is polled only while a send is waited for.
        * one-sided (Mooncake writes, NIXL pulls): the trainer writes into the consumer's buffer, so it waits for
          the consumer's "slot free" mark before sending, and the "done" mark (always set, as soon as the send
          finished) is how the consumer learns that the bytes are there."""
        peer = consumer_name(c)
        wait_s = 1.5 * self.config.timeout_s
        one_sided = self.transport.one_sided
        keep_in_flight = 1 if one_sided else 2  # one-sided: mark a group done as soon as the next one is sent
        if self.slots[c][0].is_cuda:
            torch.cuda.set_device(self.slots[c][0].device)  # a new thread starts on GPU 0
        steps = self._steps(schedule, c)
        done: set[int] = set()
        in_flight: list[tuple[int, list, list]] = []  # (group index, pendings, checksum tensors), oldest first

        def finish(entry) -> None:
            gi, pendings, _ = entry
            check = lambda: abort_mark(self.control, free_key(version, peer, gi))  # noqa: E731
            for pending in pendings:
                pending.wait(wait_s, check=check)

        def mark(entry) -> None:
            gi, _, sums = entry
            if one_sided or self.config.verify:
                self.control.set(done_key(version, self.name, peer, gi), json.dumps({"sums": [int(x) for x in sums]}))
            done.add(gi)

        try:
            begin = getattr(self.packer, "begin", None)
            if begin is not None:  # EPLB: bind this consumer's plan to the placement it published (sync/placement.py)
                record_bound(self.control, version, self.name, peer, begin(version, c))
            for k, (gi, group, pieces, segments) in enumerate(steps):
                finished = None
                if len(in_flight) == 2:  # this group's slot is still being sent from (group k-2): wait for it
                    finished = in_flight.pop(0)
                    finish(finished)
                    event(f"sent {finished[0]}")
                slot, group_tensors = self.slots[c][k % 2], tensors.get(group)
                direct = self._direct_views(c, group, group_tensors, pieces)
                staged = [i for i in segments if i not in direct] if direct else segments
                if staged:
                    self.packer.pack(c, group, group_tensors, slot, staged)
                tensors.release(group)
                event(f"pack {gi} enqueued")
                messages = [
                    (lo, hi, direct[seg] if seg in direct else slot[lo:hi])
                    for p in pieces
                    for lo, hi, seg in p.messages()
                ]
                sums = [checksum_tensor(src) for _, _, src in messages] if self.config.verify else []
                if one_sided:
                    self._await_free_slot(version, peer, gi, group, wait_s)
                pendings = [
                    self.transport.send(peer, src, Tag(version, gi, gi % 2, lo, hi - lo)) for lo, hi, src in messages
                ]
                event(f"send {gi} posted")
                in_flight.append((gi, pendings, sums))
                sent[c] += sum(p.hi - p.lo for p in pieces)
                self._direct_sent[c] += sum(v.numel() for v in direct.values())
                if finished is not None:
                    mark(finished)
                while len(in_flight) > keep_in_flight:
                    finished = in_flight.pop(0)
                    finish(finished)
                    mark(finished)
            while in_flight:
                finished = in_flight.pop(0)
                finish(finished)
                event(f"sent {finished[0]}")
                mark(finished)
        except BaseException as e:  # noqa: BLE001 - recorded and raised by sync() as SyncFailed
            failures[peer] = e
            # this rank failed, not the link: sends in flight go into receives the consumer posted, so they land
            # before the pair closes (the consumer learns why from the marks, not from torn transfers)
            for entry in in_flight if not isinstance(e, PeerError) else ():
                try:
                    finish(entry)
                except BaseException:  # noqa: BLE001 - the lane failed already; that error is the one reported
                    break
            in_flight.clear()
            self._abort(version, peer, [gi for gi, *_ in steps if gi not in done], e)

    def _direct_views(self, c: int, group: str, tensors, pieces) -> dict[int, torch.Tensor]:
        """Segment -> the bytes to send of each direct segment (Piece.direct) the packer can give as a view of the
        trainer's own tensor, where the transport sends from any memory: no copy into staging. The others are packed
        into the slot as usual, and sent as the same messages."""
        wanted = [(seg, hi - lo) for p in pieces for seg, lo, hi in p.direct]
        view = getattr(self.packer, "direct_view", None)
        if not wanted or view is None or not getattr(self.transport, "sends_any_memory", False):
            return {}
        out = {}
        for seg, nbytes in wanted:
            src = view(c, group, tensors, seg)
            if src is not None and src.numel() == nbytes and src.device == self.slots[c][0].device:
                out[seg] = src
        return out

    def _abort(self, version: int, peer: Peer, groups: list[int], error: BaseException) -> None:
        """Mark the lane's groups not yet marked done as aborted, then end the connection where the transport can
        (a two-sided receive over gloo cannot poll the marks): the consumer ends now, with this rank's reason, rather
        than time out here."""
        for gi in groups:
            self.control.set(
                done_key(version, self.name, peer, gi), f"abort: {self.name} stopped: {type(error).__name__}: {error}"
            )
        abort = getattr(self.transport, "abort", None)
        if abort is not None:
            abort(peer)

    def _await_free_slot(self, version: int, peer: Peer, gi: int, group: str, wait_s: float) -> None:
        """One-sided transports write into the consumer's buffer: wait until it says the slot is free."""
        free = self.control.get(free_key(version, peer, gi), wait_s, peer, f"receive slot for {group}")
        if not free.startswith("ok"):
            raise PeerAborted(peer, free)
        if time.time() > float(free.split()[1]) + self.config.timeout_s:
            # the consumer stopped waiting for this group: a late one-sided write could land in its next version
            raise PeerAborted(peer, f"gave up on group {group} before this trainer could send it")

    def _steps(self, schedule: Schedule, c: int) -> list[tuple[int, str, tuple[Piece, ...], list[int]]]:
        """(group index, group, this trainer's pieces, their segments) per group of consumer c it serves: a pure
        function of the schedule, computed once per schedule (thousands of segments per group in a no-EP MoE)."""
        of = self._steps_of
        if of[0] is not schedule:  # only the current schedule's are kept (EPLB schedules change with placements)
            of = self._steps_of = (schedule, {})
        steps = of[1].get(c)
        if steps is None:
            steps = []
            for gi, group in enumerate(schedule.groups):
                pieces = schedule.of(c, gi, self.rank)
                if pieces:
                    steps.append((gi, group, pieces, sorted({i for p in pieces for i in p.segments})))
            of[1][c] = steps
        return steps


class _AmaxExchange:
    """Blocks cut between trainer ranks (ShardedPacker.amax_groups), in a thread beside the lanes: group by group in
    the sync's order, publish this rank's partial block amaxes on the control channel, then take its peers' (a dead or
    stalled peer is named after the timeout). A lane waits only for the group it is about to stage (GroupTensors
    `ready`), so the exchange of later groups overlaps the sends of earlier ones instead of delaying the first byte
    by the whole model's exchange. A failed exchange fails every lane at the first group it leaves without amaxes."""

    def __init__(self, sync: TrainerSync, version: int, tensors: GroupTensors):
        self.sync, self.version, self.tensors = sync, version, tensors
        groups = getattr(sync.packer, "amax_groups", lambda: [])()
        self.events = {g: threading.Event() for g in groups}
        self.exchanged: set[str] = set()
        self.error: BaseException | None = None
        self.thread = None
        if groups:
            tensors.ready = self.wait
            self.thread = threading.Thread(target=self._run, args=(groups,), name=f"{sync.name}-amaxes", daemon=True)
            self.thread.start()

    def _run(self, groups: list[str]) -> None:
        sync = self.sync
        try:
            device = next(iter(sync.staging.values())).device if sync.staging else None
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # a new thread starts on GPU 0
            for g in groups:
                with self.tensors.lock:  # the source is called by one thread at a time
                    fetched = sync.source.group(g)
                own = sync.packer.partial_amaxes(g, fetched)
                del fetched
                sync.control.set(amax_key(self.version, sync.name, g), encode_amaxes(own))
                partials = {sync.rank: own}
                for r in sync.packer.amax_peers(g):
                    peer = trainer_name(r)
                    wait_s = sync.config.timeout_s
                    text = sync.control.get(amax_key(self.version, peer, g), wait_s, peer, f"block amaxes of {g}")
                    partials[r] = decode_amaxes(text)
                sync.packer.set_amaxes(g, partials)
                self.exchanged.add(g)
                self.events[g].set()
            event("amaxes exchanged")
        except BaseException as e:  # noqa: BLE001 - raised by the lanes that need it, and reported by sync()
            self.error = e
        finally:
            for done in self.events.values():
                done.set()

    def wait(self, group: str) -> None:
        """Before a lane stages `group` (a base group): its amaxes exchanged, or this rank's exchange error."""
        done = self.events.get(group)
        if done is None:
            return
        done.wait()
        if group not in self.exchanged:
            error = self.error
            raise AmaxExchangeError(
                f"{self.sync.name}: the block amaxes of {group} were not exchanged, so its cut blocks cannot be "
                f"quantized: {type(error).__name__}: {error}"
            )

    def join(self) -> BaseException | None:
        if self.thread is not None:
            self.thread.join()  # every wait in it has a deadline; only this rank's own source can stall it
        return self.error
