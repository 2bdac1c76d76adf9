"""The discrete-event simulation of one sync over the `nccl` transport (the engine's two-sided pipeline).

It replays, per rank, the steps `shardplan.sync` takes under the two-sided policy (TrainerSync._lane,
ConsumerSync.sync), against the Schedule the real `build_schedule` made, on the machine model of `fleet.py`:

  trainer t, one lane per consumer it serves (lanes share the process's one CPU thread and the GPU's one stream):
      for each of the lane's groups k:  if two groups are in flight, wait for the sends of group k-2;
                                        enqueue the pack of k (GPU stream); post one send per piece (CPU);
                                        a send starts once the GPU stream has run everything enqueued before it
  consumer c: post the receives of groups 0 and 1; for each group g in order: wait for all its pieces, enqueue its
      apply, post the receives of g+2 (they start writing once the stream has run the apply: the slot is free)
  a piece moves once its send and its receive are both ready and the pair's previous piece has moved (one NCCL
  communicator per pair, operations in posting order), after the link's fixed latency, at the rate its two ports
  give it (max-min fair share among the transfers using them, recomputed at every start and end).

Every activity records what it waited for last (its cause), so the critical path is read backwards from the last
consumer to finish.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np

from shardplan.simulate.fleet import Fleet, Links, UnreachableConsumerError
from shardplan.sync import Schedule

NVLINK_OUT, NVLINK_IN, NET_OUT, NET_IN = range(4)
PORT_NAMES = ("NVLink out", "NVLink in", "NIC out", "NIC in")


@dataclass(slots=True)
class Activity:
    """One pack, transfer or apply (or a rank's start/end): when it ran and what it waited for last."""

    kind: str  # "start", "pack", "transfer", "apply", "end"
    rank: str  # "trainer3" / "consumer5"
    peer: str  # the other side of a pack/transfer ("" otherwise)
    group: int  # group index in the schedule (-1 for start/end)
    start: float
    end: float
    nbytes: int
    cause: int | None  # index of the activity whose end decided this start; None: the sync's start
    port: int = -1  # transfers: the port that limited it most (index into the port arrays)


def max_min_rates(port_a: np.ndarray, port_b: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows that each use two ports (progressive filling): every flow gets the same rate
    until a port is full; flows through full ports stop growing; the rest go on."""
    n = len(port_a)
    ports, inverse = np.unique(np.concatenate([port_a, port_b]), return_inverse=True)  # only the ports in use
    a, b = inverse[:n], inverse[n:]
    num_ports = len(ports)
    left = caps[ports].astype(np.float64)
    count = (np.bincount(a, minlength=num_ports) + np.bincount(b, minlength=num_ports)).astype(np.float64)
    rates = np.zeros(n)
    level = 0.0
    moving = np.arange(n)  # flows still growing
    share = np.empty(num_ports)
    while len(moving):
        share.fill(np.inf)
        np.divide(left, count, out=share, where=count > 0)
        step = share.min()
        level += step
        left -= step * count
        full = share <= step * (1 + 1e-9)
        stop = full[a[moving]] | full[b[moving]]
        stopped = moving[stop]
        rates[stopped] = level
        count -= np.bincount(a[stopped], minlength=num_ports) + np.bincount(b[stopped], minlength=num_ports)
        moving = moving[~stop]
    return rates


class _Piece:
    __slots__ = (
        "trainer",
        "consumer",
        "group",
        "nbytes",
        "port_a",
        "port_b",
        "latency",
        "pending",
        "ready",
        "cause",
        "activity",
        "done",
        "waiters",
        "flow_start_bytes",
    )

    def __init__(self, trainer, consumer, group, nbytes, port_a, port_b, latency):
        self.trainer, self.consumer, self.group, self.nbytes = trainer, consumer, group, nbytes
        self.port_a, self.port_b, self.latency = port_a, port_b, latency
        self.pending = 3  # send ready, receive ready, the pair's previous piece moved
        self.ready, self.cause = 0.0, None
        self.activity: int | None = None
        self.done: float | None = None
        self.waiters: list = []


class Simulation:
    """One sync: call run() once. `bytes_scale` scales every byte count (0.5: an FP8 estimate from a BF16 plan).
    `rate_quantum_s` > 0 recomputes the shared rates at most once per that much simulated time (a transfer that
    starts in between waits for the next recomputation, capacity freed in between idles): exact at 0, faster on
    fleets with thousands of transfers in flight. `group_order="rotated"` is a what-if the engine does not do: each
    consumer starts at a different group and wraps around."""

    def __init__(
        self,
        schedule: Schedule,
        fleet: Fleet,
        links: Links,
        *,
        bytes_scale: float = 1.0,
        rate_quantum_s: float = 0.0,
        group_order: str = "engine",
    ):
        if group_order not in ("engine", "rotated"):
            raise ValueError(f"group_order must be 'engine' or 'rotated', got {group_order!r}")
        self.schedule, self.fleet, self.links, self.scale = schedule, fleet, links, bytes_scale
        self.group_order = group_order
        self.rate_quantum = rate_quantum_s
        g = fleet.gpus_per_node
        self.trainer_gpu = {t: n * g + i for t, (n, i) in enumerate(fleet.trainer_gpus)}
        self.consumer_gpu = {c: n * g + i for c, (n, i) in enumerate(fleet.consumer_gpus)}
        num_gpus = fleet.num_nodes * g
        caps = np.zeros(4 * num_gpus)
        caps[NVLINK_OUT::4] = caps[NVLINK_IN::4] = links.nvlink_GBps * 1e9
        caps[NET_OUT::4] = caps[NET_IN::4] = (links.network_GBps or 0) * 1e9
        self.caps = caps
        self.base_caps = caps.copy()
        self.port_bytes = np.zeros(len(caps))
        self.activities: list[Activity] = []
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.cpu_free: dict[str, float] = {}
        self.gpu_free: dict[int, tuple[float, int | None]] = {}  # gpu -> (end of the last kernel enqueued, its id)
        self.flows_changed = False
        self.kernels_running: dict[int, int] = {}
        self.pieces: dict[tuple[int, int], list[_Piece]] = {}
        self.pair_last: dict[tuple[int, int], _Piece] = {}
        self.rate_series: list[tuple[float, float, float]] = []  # (time, NIC bytes/s, NVLink bytes/s)
        self.consumer_end: dict[int, float] = {}
        self.trainer_end: dict[int, float] = {}
        self._make_pieces()
        # transfers moving bytes, in slots of fixed arrays (a slot is reused once its transfer ended)
        num_slots = max(1, sum(len(v) for v in self.pieces.values()))
        self.slot_piece: list[_Piece | None] = [None] * num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.rem, self.size = np.zeros(num_slots), np.zeros(num_slots)
        self.pa, self.pb = np.zeros(num_slots, dtype=np.int64), np.zeros(num_slots, dtype=np.int64)
        self.active = np.zeros(num_slots, dtype=bool)

    # ---- set-up -------------------------------------------------------------------------------------------------
    def _make_pieces(self) -> None:
        links, s = self.links, self.schedule
        for (c, gi), pieces in sorted(s.pieces.items()):
            if c not in self.consumer_gpu:
                raise UnreachableConsumerError(
                    f"consumer rank {c} is in the schedule but the fleet places only "
                    f"{len(self.consumer_gpu)} consumer ranks; add inference nodes"
                )
            out = []
            for p in pieces:
                if p.trainer not in self.trainer_gpu:
                    raise UnreachableConsumerError(
                        f"consumer rank {c}: trainer rank {p.trainer} serves it but the "
                        f"fleet places only {len(self.trainer_gpu)} trainer ranks"
                    )
                tg, cg = self.trainer_gpu[p.trainer], self.consumer_gpu[c]
                same_node = tg // self.fleet.gpus_per_node == cg // self.fleet.gpus_per_node
                if not same_node and links.network_GBps is None:
                    raise UnreachableConsumerError(
                        f"consumer rank {c} (node {cg // self.fleet.gpus_per_node}) needs bytes of group "
                        f"{s.groups[gi]} from trainer rank {p.trainer} (node {tg // self.fleet.gpus_per_node}) and "
                        f"the links have no network (nic_GBps=None); give the fleet a NIC or place them on one node"
                    )
                if same_node:
                    ports, latency = (4 * tg + NVLINK_OUT, 4 * cg + NVLINK_IN), links.nvlink_latency_us * 1e-6
                else:
                    ports, latency = (4 * tg + NET_OUT, 4 * cg + NET_IN), links.nic_latency_us * 1e-6
                out.append(_Piece(p.trainer, c, gi, (p.hi - p.lo) * self.scale, *ports, latency))
            self.pieces[(c, gi)] = out

    # ---- primitives the rank processes use -----------------------------------------------------------------------
    def _push(self, time: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, fn, args))

    def _record(self, kind, rank, peer, group, start, end, nbytes, cause, port=-1) -> int:
        self.activities.append(Activity(kind, rank, peer, group, start, end, int(nbytes), cause, port))
        return len(self.activities) - 1

    def _kernel(
        self, gpu: int, kind: str, rank: str, peer: str, group: int, nbytes: float, rate_GBps: float, cause: int | None
    ) -> tuple[float, int]:
        """Enqueue a kernel on the GPU's stream now; returns (end, activity id)."""
        free, last = self.gpu_free.get(gpu, (0.0, None))
        start = max(self.now, free)
        end = start + nbytes / (rate_GBps * 1e9)
        aid = self._record(kind, rank, peer, group, start, end, nbytes, last if free > self.now else cause)
        self.gpu_free[gpu] = (end, aid)
        if self.links.overlap_slowdown and end > start:
            self._push(start, self._slow, gpu, 1)
            self._push(end, self._slow, gpu, -1)
        return end, aid

    def _slow(self, gpu: int, delta: int) -> None:
        self.kernels_running[gpu] = self.kernels_running.get(gpu, 0) + delta
        ports = slice(4 * gpu, 4 * gpu + 4)
        factor = (1 - self.links.overlap_slowdown) if self.kernels_running[gpu] > 0 else 1.0
        self.caps[ports] = self.base_caps[ports] * factor
        self.flows_changed = True

    def _stream_ready(self, gpu: int, cause: int | None) -> tuple[float, int | None]:
        """When a transfer posted now may start on this GPU: after everything enqueued on its stream so far."""
        free, last = self.gpu_free.get(gpu, (0.0, None))
        return (free, last) if free > self.now else (self.now, cause)

    def _condition(self, piece: _Piece, time: float, cause: int | None) -> None:
        if time >= piece.ready:
            piece.ready, piece.cause = time, cause
        piece.pending -= 1
        if piece.pending == 0:
            self._push(piece.ready + piece.latency, self._begin, piece)

    def _begin(self, piece: _Piece) -> None:
        piece.flow_start_bytes = (self.port_bytes[piece.port_a], self.port_bytes[piece.port_b])
        piece.activity = self._record(
            "transfer",
            f"trainer{piece.trainer}",
            f"consumer{piece.consumer}",
            piece.group,
            piece.ready,
            piece.ready,
            piece.nbytes,
            piece.cause,
        )
        if piece.nbytes <= 0:
            self._finish(piece)
            return
        slot = self.free_slots.pop()
        self.slot_piece[slot] = piece
        self.rem[slot] = self.size[slot] = piece.nbytes
        self.pa[slot], self.pb[slot] = piece.port_a, piece.port_b
        self.active[slot] = True
        self.flows_changed = True

    def _finish(self, piece: _Piece) -> None:
        piece.done = self.now
        act = self.activities[piece.activity]
        act.end = self.now
        if piece.nbytes > 0 and self.now > act.start:
            dt = self.now - act.start
            use_a = (self.port_bytes[piece.port_a] - piece.flow_start_bytes[0]) / (self.base_caps[piece.port_a] * dt)
            use_b = (self.port_bytes[piece.port_b] - piece.flow_start_bytes[1]) / (self.base_caps[piece.port_b] * dt)
            act.port = piece.port_a if use_a >= use_b else piece.port_b
        nxt = self.pair_next.get(id(piece))
        if nxt is not None:
            self._condition(nxt, self.now, piece.activity)
        for waiter in piece.waiters:
            waiter()

    # ---- processes: generators yielding what they wait for --------------------------------------------------------
    def _run_process(self, proc: Iterator, cpu: str) -> None:
        def step(_=None):
            for command, arg in proc:
                if command == "cpu":  # the process's one thread: requests are served in order
                    start = max(self.now, self.cpu_free.get(cpu, 0.0))
                    self.cpu_free[cpu] = start + arg
                    self._push(start + arg, step)
                    return
                if command == "at":
                    self._push(max(self.now, arg), step)
                    return
                if command == "wait":  # pieces: resume once all moved (plus the poll delay)
                    pending = [p for p in arg if p.done is None]
                    if not pending:
                        self._push(max([self.now] + [p.done for p in arg]) + self.links.poll_us * 1e-6, step)
                        return
                    counter = [len(pending)]

                    def one_done(counter=counter):
                        counter[0] -= 1
                        if counter[0] == 0:
                            self._push(self.now + self.links.poll_us * 1e-6, step)

                    for p in pending:
                        p.waiters.append(one_done)
                    return

        self._push(self.links.start_us * 1e-6, step)

    def _trainer(self, t: int, lane_of: Mapping[int, list]) -> None:
        lanes_left = [len(lane_of)]
        ends: list[float] = []
        for c, steps in lane_of.items():
            self._run_process(self._lane(t, c, steps, lanes_left, ends), f"trainer{t}")

    def _lane(self, t: int, c: int, steps: list, lanes_left: list, ends: list) -> Iterator:
        links, gpu, me = self.links, self.trainer_gpu[t], f"trainer{t}"
        in_flight: deque = deque()
        cause = None
        for gi, pieces in steps:
            if len(in_flight) == 2:
                oldest = in_flight.popleft()
                yield "wait", oldest
                cause = max(oldest, key=lambda p: p.done).activity
            yield "cpu", links.launch_us * 1e-6
            nbytes = sum(p.nbytes for p in pieces)
            self._kernel(gpu, "pack", me, f"consumer{c}", gi, nbytes, links.pack_GBps, cause)
            for p in pieces:
                yield "cpu", links.post_us * 1e-6
                self._condition(p, *self._stream_ready(gpu, cause))
            in_flight.append(pieces)
        while in_flight:
            oldest = in_flight.popleft()
            yield "wait", oldest
        lanes_left[0] -= 1
        if lanes_left[0] == 0:
            self.trainer_end[t] = self.now

    def _consumer(self, c: int) -> Iterator:
        links, gpu, me = self.links, self.consumer_gpu[c], f"consumer{c}"
        order = self.order[c]
        slot_cause: list[int | None] = [None, None]

        def post(k):
            for p in self.pieces.get((c, order[k]), ()):
                yield "cpu", links.post_us * 1e-6
                self._condition(p, *self._stream_ready(gpu, slot_cause[k % 2]))

        for k in range(min(2, len(order))):
            yield from post(k)
        cause = None
        for k, gi in enumerate(order):
            pieces = self.pieces.get((c, gi), [])
            if pieces:
                yield "wait", pieces
                cause = max(pieces, key=lambda p: p.done).activity
                yield "cpu", links.launch_us * 1e-6
                _, slot_cause[k % 2] = self._kernel(
                    gpu, "apply", me, "", gi, sum(p.nbytes for p in pieces), links.apply_GBps, cause
                )
            if k + 2 < len(order):
                yield from post(k + 2)
        yield "cpu", links.finish_us * 1e-6
        free, last = self.gpu_free.get(gpu, (0.0, None))
        end = max(self.now, free)
        self._record("end", me, "", -1, end, end, 0, last if free > self.now else cause)
        self.consumer_end[c] = end

    # ---- the event loop -------------------------------------------------------------------------------------------
    def run(self) -> "Simulation":
        s = self.schedule
        num_groups = len(s.groups)
        # the engine takes the groups in schedule order; "rotated" (a what-if, not the engine): consumer i of n starts
        # at group i * G // n and wraps around, so consumers spread over the layers (and over PP trainer stages)
        self.order = {c: list(range(num_groups)) for c in s.consumers}
        if self.group_order == "rotated":
            for i, c in enumerate(s.consumers):
                start = i * num_groups // len(s.consumers)
                self.order[c] = list(range(start, num_groups)) + list(range(start))
        position = {c: {gi: k for k, gi in enumerate(order)} for c, order in self.order.items()}
        # per pair, pieces move in posting order: the trainer posts group by group, piece by piece
        self.pair_next: dict[int, _Piece] = {}
        by_pair: dict[tuple[int, int], list[_Piece]] = {}
        for (c, gi), pieces in sorted(self.pieces.items(), key=lambda kv: (position[kv[0][0]][kv[0][1]], kv[0][0])):
            for p in pieces:
                by_pair.setdefault((p.trainer, c), []).append(p)
        for chain in by_pair.values():
            chain[0].pending -= 1
            for a, b in zip(chain, chain[1:]):
                self.pair_next[id(a)] = b
        lanes: dict[int, dict[int, list]] = {}
        for (t, c), chain in sorted(by_pair.items()):
            steps: dict[int, list[_Piece]] = {}
            for p in chain:
                steps.setdefault(p.group, []).append(p)
            lanes.setdefault(t, {})[c] = sorted(steps.items(), key=lambda kv: position[c][kv[0]])
        for t in s.trainers:
            if t in lanes:
                self._trainer(t, lanes[t])
        for c in s.consumers:
            self._run_process(self._consumer(c), f"consumer{c}")
        self._loop()
        return self

    def _loop(self) -> None:
        idx = np.zeros(0, dtype=np.int64)  # slots of the transfers moving bytes now
        rates = np.zeros(0)
        num_ports = len(self.port_bytes)
        last_rates, recompute_due = -math.inf, False
        while self.heap or len(idx) or self.flows_changed:
            t_event = self.heap[0][0] if self.heap else math.inf
            t_flow = self.now + float(np.min(self.rem[idx] / rates)) if len(idx) else math.inf
            t = min(t_event, t_flow)
            if t == math.inf:
                raise RuntimeError(f"simulation stalled at {self.now:.6f} s: transfers wait for rates that never come")
            if len(idx) and t > self.now:
                moved = rates * (t - self.now)
                self.port_bytes += np.bincount(self.pa[idx], moved, num_ports) + np.bincount(
                    self.pb[idx], moved, num_ports
                )
                self.rem[idx] -= moved
            self.now = t
            if len(idx) and t_flow <= t_event:
                done = self.rem[idx] <= 1e-6 * self.size[idx] + 1e-3
                finished = idx[done]
                idx, rates = idx[~done], rates[~done]
                self.active[finished] = False
                self.flows_changed = True
                for slot in finished.tolist():
                    piece = self.slot_piece[slot]
                    self.slot_piece[slot] = None
                    self.free_slots.append(slot)
                    self._finish(piece)
            while self.heap and self.heap[0][0] <= self.now:
                _, _, fn, args = heapq.heappop(self.heap)
                fn(*args)
            if not self.flows_changed:
                continue
            if len(idx) and self.now < last_rates + self.rate_quantum:
                # rates are recomputed at most once per quantum; until then new transfers wait, freed capacity idles
                if not recompute_due:
                    recompute_due = True
                    self._push(last_rates + self.rate_quantum, self._recompute_due)
                continue
            self.flows_changed, recompute_due, last_rates = False, False, self.now
            idx = np.flatnonzero(self.active)
            rates = max_min_rates(self.pa[idx], self.pb[idx], self.caps) if len(idx) else np.zeros(0)
            net = (self.pa[idx] % 4) == NET_OUT
            self.rate_series.append((self.now, float(rates[net].sum()), float(rates[~net].sum())))

    def _recompute_due(self) -> None:
        self.flows_changed = True
