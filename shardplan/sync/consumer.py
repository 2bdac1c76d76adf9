"""A consumer (inference) rank of the sync: receives each group into one of two buffers, verifies, applies."""

from __future__ import annotations

import time

import torch

from shardplan.runtime.tensors import align_up
from shardplan.sync.control import abort_mark, check_sum, done_key, free_key, join
from shardplan.sync.rank import Rank
from shardplan.sync.schedule import Schedule, checksum_tensor
from shardplan.sync.stages import LayoutMismatch, SyncConfig, SyncReport, SyncState, Unpacker, event
from shardplan.transport.base import (
    Control,
    Peer,
    PeerAborted,
    PeerDied,
    Tag,
    Transport,
    consumer_name,
    deadline_after,
    left,
    trainer_name,
)


class ConsumerSync(Rank):
    """One consumer (inference) rank: two receive buffers, each the size of its largest group, registered once."""

    def __init__(
        self,
        rank: int,
        unpacker: Unpacker,
        transport: Transport,
        control: Control,
        config: SyncConfig | None = None,
        device: torch.device | str = "cpu",
        initial_version: int = 0,
    ):
        self.rank, self.name = rank, consumer_name(rank)
        self.unpacker = unpacker
        self.sizes = dict(unpacker.sizes())
        super().__init__(transport, control, config)
        size = align_up(max(self.sizes.values(), default=1), 256)
        self.buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2)]
        transport.register(self.buffers)
        control.prewarm(4)  # this rank's waits and its transport's pair rendezvous, opened now rather than mid-sync
        self._state = SyncState(initial_version, True)
        self.stamps = {rank: unpacker.stamp()}
        self.epoch = join(control, self.name, None, self.stamps)

    @property
    def state(self) -> SyncState:
        """(version of the weights held, whether every byte of that version arrived, verified, and was applied)."""
        return self._state

    def prepare(self, version: int) -> None:
        """The control-plane part of syncing `version`, ahead of it: read the announcement and schedule, check them
        against this rank's plan, open connections to this version's trainers (see TrainerSync.prepare)."""
        ann, schedule = self._announcement(version)
        c, groups = self.rank, schedule.groups
        trainers = sorted({p.trainer for gi in range(len(groups)) for p in schedule.of(c, gi)})
        mismatched = self._mismatches(ann, [(trainer_name(t), c) for t in trainers])
        for gi, group in enumerate(groups):
            if schedule.nbytes[c][gi] > self.sizes.get(group, 0) and not mismatched:
                mismatched["coordinator"] = LayoutMismatch(
                    "coordinator",
                    f"the trainers' buffer of {group} for {self.name} has {schedule.nbytes[c][gi]} "
                    f"bytes, this rank's has {self.sizes.get(group, 0)}: the coordinator was given "
                    f"other plans than this rank's",
                )
        self.transport.connect(
            {self.name: self.epoch, **{trainer_name(t): ann["members"][trainer_name(t)] for t in trainers}}
        )
        self._prepared = (version, schedule, trainers, mismatched)

    def sync(self, version: int) -> SyncReport:
        """Post the receives of groups 0 and 1; per group, wait for its bytes, checksum them, apply, and post the
        receive of group k+2 into the freed slot. How arrival is learnt is the transport's (see TrainerSync._lane):

        * two-sided: from the receive itself (polling the trainers' abort marks only while waiting); checksums are
          enqueued on the device and compared once, at the end, before the version is committed, so no
          control-channel round trip sits between two transfers (on the GPU the next receive waits for the apply
          through stream order);
        * one-sided: from the trainer's "done" mark, which carries the checksums, so each group is verified before it
          is applied; posting a receive also sets the slot's "free" mark the trainer waits for."""
        start = time.monotonic()
        event("consumer sync")
        schedule, trainers, mismatched = self._take_prepared(version)
        groups, one_sided = schedule.groups, self.transport.one_sided
        posted: dict[int, list] = {}
        deferred: list[tuple[int, int, int, int, int, torch.Tensor]] = []  # (group, trainer, j, lo, hi, checksum)
        received = 0
        failures: dict[Peer, BaseException] = dict(mismatched)

        def post(gi: int) -> None:
            posted[gi] = self._post_receives(version, schedule, gi)
            if one_sided:
                self.control.set(free_key(version, self.name, gi), f"ok {time.time():.6f}")

        try:
            if mismatched:  # refused before any byte moves; the weights held stay as they are, complete
                raise next(iter(mismatched.values()))
            for gi in range(min(2, len(groups))):
                post(gi)
            event("first receives posted")
            for gi, group in enumerate(groups):
                buf = self.buffers[gi % 2]
                deadline = deadline_after(self.config.timeout_s)
                seen: dict[int, int] = {}
                for (trainer, lo, hi), (pending, view) in zip(self._messages(schedule, gi), posted.pop(gi)):
                    peer = trainer_name(trainer)
                    key = done_key(version, peer, self.name, gi)
                    mark = self._mark(key, left(deadline), peer, f"bytes of {group}") if one_sided else None
                    try:
                        pending.wait(max(left(deadline), 0.001), check=lambda: abort_mark(self.control, key))
                    except PeerDied:  # a trainer that gave up closes the pair after leaving its reason
                        mark = abort_mark(self.control, key)
                        if mark is None:
                            raise
                        raise PeerAborted(peer, mark) from None
                    event(f"received {gi}")
                    j = seen[trainer] = seen.get(trainer, -1) + 1
                    if self.config.verify:
                        got = checksum_tensor(view)
                        if mark is not None:
                            check_sum(peer, mark, j, int(got), lo, hi, group)
                        else:
                            deferred.append((gi, trainer, j, lo, hi, got))
                    received += hi - lo
                pending = view = None  # a view left here would keep an in-place target's storage in use
                self._apply(version, group, buf)
                event(f"apply {gi} enqueued")
                if gi + 2 < len(groups):
                    post(gi + 2)
                    event(f"receive {gi + 2} posted")
            deadline = deadline_after(self.config.timeout_s)
            for gi, trainer, j, lo, hi, got in deferred:
                peer = trainer_name(trainer)
                mark = self._mark(
                    done_key(version, peer, self.name, gi), left(deadline), peer, f"checksums of {groups[gi]}"
                )
                check_sum(peer, mark, j, int(got), lo, hi, groups[gi])
            self._state = SyncState(version, True)
        except BaseException as e:  # noqa: BLE001 - recorded and raised by _finish as SyncFailed
            failures[getattr(e, "peer", self.name)] = e
            for gi in range(len(groups)):  # trainers waiting for a free slot or on a send to this rank end now
                self.control.set(free_key(version, self.name, gi), f"abort: {self.name} gave up: {e}")
        event("committed")
        self._finish(version, failures)
        event("result set")
        return SyncReport(
            self.name, version, time.monotonic() - start, received, tuple(trainer_name(t) for t in trainers)
        )

    def _mark(self, key: str, timeout_s: float, peer: Peer, what: str) -> str:
        """A trainer's "done" mark (its checksums), or PeerAborted with the message it left instead."""
        mark = self.control.get(key, timeout_s, peer, what)
        if mark.startswith("abort"):
            raise PeerAborted(peer, mark)
        return mark

    def _messages(self, schedule: Schedule, gi: int) -> list[tuple[int, int, int]]:
        """(trainer, lo, hi) of every message of group gi, in the order both sides post them (Piece.messages)."""
        return [(p.trainer, lo, hi) for p in schedule.of(self.rank, gi) for lo, hi, _ in p.messages()]

    def _post_receives(self, version: int, schedule: Schedule, gi: int) -> list[tuple]:
        """Post the receives of group gi's messages into its slot (gi % 2), or, where the unpacker gives one and the
        transport receives into any memory, straight into the destination it gives (Unpacker.receive_targets);
        (Pending, the view received into) per message."""
        buf = self.buffers[gi % 2]
        messages = self._messages(schedule, gi)
        targets = [None] * len(messages)
        choose = getattr(self.unpacker, "receive_targets", None)
        if choose is not None and getattr(self.transport, "receives_any_memory", False):
            targets = choose(schedule.groups[gi], [(lo, hi) for _, lo, hi in messages])
        out = []
        for (t, lo, hi), target in zip(messages, targets):
            view = buf[lo:hi] if target is None else target
            out.append((self.transport.recv(trainer_name(t), view, Tag(version, gi, gi % 2, lo, hi - lo)), view))
        return out

    def _apply(self, version: int, group: str, buf: torch.Tensor) -> None:
        if self.sizes.get(group, 0):
            if self._state != SyncState(version, False):
                self._state = SyncState(version, False)  # params now hold a mix of two versions
            self.unpacker.apply(group, buf[: self.sizes[group]])
