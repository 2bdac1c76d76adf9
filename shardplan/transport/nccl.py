"""`nccl`: torch.distributed point-to-point between one trainer and one consumer, one 2-rank process group per pair.

Recipe: every (trainer, consumer) pair that has bytes to move gets its own 2-rank process group, built directly from
the control store (`ProcessGroupNCCL(PrefixStore("nccl/trainer0.3/consumer2.1", store), rank, 2, ...)`, trainer is
rank 0). No default process group, no world: a dead consumer breaks only its own pairs, a restarted one gets fresh
pairs (the prefix carries both epochs), and the trainer never joins a collective that could hang on it.
Sends and receives are `pg.send/recv` of views of pre-allocated buffers, posted in the same order on both sides.

On CUDA the backend is NCCL: communicators initialise lazily at the first transfer of a pair. On CPU the backend is
gloo (same code, used by the CPU tests). NCCL waits poll `work.is_completed()` against a deadline (and the engine's
abort check) and abort the pair's communicator when they give up (NCCL would otherwise block until its watchdog
fires); gloo's own `work.wait(timeout)` enforces the deadline, and a dead gloo peer surfaces as a closed connection.
Two-sided: the engine needs no "slot free" / "bytes done" marks per group with this adapter (see shardplan.sync).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from shardplan.transport.base import (
    Control,
    Done,
    Failed,
    Peer,
    PeerAborted,
    PeerDied,
    PeerTimeout,
    Tag,
    deadline_after,
    left,
)


class _Pair:
    """One 2-rank process group; rank 0 is the trainer."""

    def __init__(self, pg, key: tuple[int, int]):
        self.pg, self.key = pg, key


class _Work:
    def __init__(self, work, peer: Peer, pair: _Pair, backend: str):
        self.work, self.peer, self.pair, self.backend = work, peer, pair, backend

    def wait(self, timeout_s: float, check=None) -> None:
        if self.backend == "gloo":
            # gloo: a send/recv work reports completion only through wait(), and a wait that times out breaks the
            # pair, so there is one wait with the whole deadline (no `check` slices; a dead gloo peer closes the
            # connection, which ends the wait at once anyway)
            try:
                self.work.wait(timedelta(seconds=max(timeout_s, 0.001)))
            except RuntimeError as e:
                text = str(e)
                if "timed out" in text.lower() or "timeout" in text.lower():
                    raise PeerTimeout(self.peer, f"transfer did not finish within {timeout_s:.1f} s") from None
                raise PeerDied(self.peer, f"connection failed: {text.splitlines()[0]}") from None
            finally:
                self.work = None  # a gloo work keeps its pair's connections open (NcclTransport.abort)
            return
        deadline = deadline_after(timeout_s)
        # NCCL: never block the CPU inside NCCL; poll the work's CUDA event against our own deadline, calling `check`
        # every CHECK_EVERY_S. The first polls are tight: in a pipelined sync the next transfer is posted right after.
        pause, next_check = 2e-5, time.monotonic() + CHECK_EVERY_S
        while not self.work.is_completed():
            if left(deadline) == 0:
                self._abort()  # NCCL: unblocks the stream; the pair is re-created at the next epoch
                raise PeerTimeout(self.peer, f"NCCL transfer did not finish within {timeout_s:.1f} s")
            if check is not None and time.monotonic() > next_check:
                self._check(check)
                next_check = time.monotonic() + CHECK_EVERY_S
            time.sleep(pause)
            pause = min(pause * 1.5, 5e-5)  # finishing late is the cost that counts: the last group's ends the sync
        try:
            self.work.wait()  # raises the transfer's error, if any; on CUDA orders the current stream after it
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise PeerDied(self.peer, f"NCCL transfer failed: {text}") from None

    def _abort(self) -> None:
        if self.pair.pg is not None:
            self.pair.pg.abort()

    def _check(self, check) -> None:
        message = check()
        if message:
            self._abort()  # the posted transfer would otherwise block the stream forever
            raise PeerAborted(self.peer, message)


CHECK_EVERY_S = 0.05


class NcclTransport:
    """torch.distributed pairs. Options: `me` (this endpoint's name), `control`, `device`, `timeout_s` (rendezvous
    of a new pair), `backend` ("nccl" on CUDA, "gloo" on CPU by default)."""

    one_sided = False
    sends_any_memory = True  # nothing registered: a send may read a trainer's tensor itself (TrainerSync direct spans)
    receives_any_memory = True  # and a receive may land in a consumer's param itself (Unpacker.receive_targets)

    def __init__(
        self,
        *,
        me: Peer,
        control: Control,
        device: torch.device | str = "cpu",
        timeout_s: float = 30.0,
        backend: str | None = None,
    ):
        self.me, self.control, self.timeout_s = me, control, timeout_s
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.pairs: dict[Peer, _Pair] = {}
        self.broken: dict[Peer, Exception] = {}
        self.is_trainer = me.startswith("trainer")

    def register(self, buffers: Sequence[torch.Tensor]) -> None:
        pass  # NCCL and gloo send from any device memory; nothing to register

    def connect(self, peers: Mapping[Peer, int]) -> None:
        my_epoch = peers[self.me]
        wanted = {p: (my_epoch, e) for p, e in peers.items() if p != self.me}
        for peer in list(self.pairs):
            if wanted.get(peer) != self.pairs[peer].key:
                self._drop(peer)
        self.broken = {}  # errors of earlier versions are stale: a failed pair changed epoch and is rebuilt below
        todo = [p for p in wanted if p not in self.pairs]
        # gloo's constructor blocks until the peer constructs too: build all pairs at once, each with a deadline.
        threads = [threading.Thread(target=self._open, args=(p, wanted[p]), daemon=True) for p in todo]
        for t in threads:
            t.start()
        deadline = deadline_after(self.timeout_s + 1.0)
        for t in threads:
            t.join(left(deadline))
        for p in todo:
            if p not in self.pairs and p not in self.broken:
                self.broken[p] = PeerTimeout(p, f"did not open its {self.backend} pair within {self.timeout_s:.1f} s")

    def _open(self, peer: Peer, key: tuple[int, int]) -> None:
        trainer, consumer = (self.me, peer) if self.is_trainer else (peer, self.me)
        t_epoch, c_epoch = key if self.is_trainer else (key[1], key[0])
        prefix = f"nccl/{trainer}.{t_epoch}/{consumer}.{c_epoch}/"
        try:
            # a store client of its own: NCCL keeps using it (lazy communicator init); gloo only to rendezvous
            client = self.control.lease()
            store = dist.PrefixStore(prefix, client)
            rank = 0 if self.is_trainer else 1
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # this runs in a fresh thread, which starts on GPU 0
            if self.backend == "gloo":
                pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=self.timeout_s))
                self.control.release(client)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timedelta(seconds=max(self.timeout_s, 60.0))
                pg = dist.ProcessGroupNCCL(store, rank, 2, options)
            pair = _Pair(pg, key)
            # First transfer of the pair, posted by both sides now: NCCL creates a pair's communicator lazily, inside
            # the first send/recv, and that call blocks until the peer joins. Left to the sync, the consumer's first
            # receive would block before it could announce "slot free", which the trainer waits for to send.
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            work = pg.send([probe], 1, 0) if self.is_trainer else pg.recv([probe], 0, 0)
            _Work(work, peer, pair, self.backend).wait(self.timeout_s)
            self.pairs[peer] = pair
        except Exception as e:  # noqa: BLE001 - recorded, raised from this peer's next send/recv
            self.broken[peer] = PeerDied(peer, f"could not open {self.backend} pair: {str(e).splitlines()[0]}")

    def _drop(self, peer: Peer) -> None:
        pair = self.pairs.pop(peer, None)
        if pair is not None and pair.pg is not None:
            pg, pair.pg = pair.pg, None  # the last reference (a _Work keeps the _Pair, not the group)
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort: the pair is never used again either way
                pass

    def abort(self, peer: Peer) -> None:
        """This side gave up on `peer` mid-sync (after its transfers in flight finished): end the pair now, so that
        the peer's posted transfers fail at once instead of at their deadline. A gloo receive cannot poll anything
        while it waits, and gloo's abort() leaves the connections open; destroying the pair's process group (with no
        unfinished work left on it) closes them. NCCL: the communicator is aborted. The pair is re-opened at the next
        version (a failed sync changes the epochs)."""
        self._drop(peer)

    def _post(self, peer: Peer, tensor: torch.Tensor, sending: bool):
        if peer in self.broken:
            return Failed(self.broken[peer])
        pair = self.pairs.get(peer)
        if pair is None:
            return Failed(PeerDied(peer, "not connected in this version"))
        other = 1 if self.is_trainer else 0
        try:
            work = pair.pg.send([tensor], other, 0) if sending else pair.pg.recv([tensor], other, 0)
        except RuntimeError as e:
            return Failed(PeerDied(peer, f"could not post transfer: {str(e).splitlines()[0]}"))
        return _Work(work, peer, pair, self.backend)

    def send(self, peer: Peer, src: torch.Tensor, tag: Tag):
        return self._post(peer, src, True) if src.numel() else Done()

    def recv(self, peer: Peer, dst: torch.Tensor, tag: Tag):
        return self._post(peer, dst, False) if dst.numel() else Done()

    def close(self) -> None:
        for peer in list(self.pairs):
            self._drop(peer)
