"""Sync worlds and clusters the sync tests share (tests/integration/test_sync.py, test_eplb_sync.py, test_fp8_sync.py,
test_engine_driver.py):
  - `LocalCluster(transport, build, ...)`: ranks as spawned processes on 127.0.0.1 ("nccl" over gloo, "mooncake:tcp")
  - `RayCluster(transport, build, ...)`: ranks as Ray actors ("rdt:gloo", "rdt:nixl"); needs ray.init first (the
    `ray_session` fixture of tests/integration/conftest.py)
  - `build_rank(world_factory, name, transport, control)`: builds a TrainerSync / ConsumerSync from a world
  - `run_sync(world_factory, transport)`: one whole sync, returns {consumer: {group: received bytes}}
A "world" is anything with `num_trainers`, `num_consumers`, `groups`, `spans`, `packer(rank)`, `source(rank)`,
`unpacker(rank)`: the stand-in world here, or one built from real plans (Replayer / Applier adapters).
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing as mp
import os
import time
import warnings
from dataclasses import dataclass, field

import torch

from shardplan.plan.ir import TensorMeta
from shardplan.plan.names import group_of
from shardplan.sync import (
    ConsumerSync,
    Coordinator,
    Span,
    SyncConfig,
    SyncFailed,
    SyncState,
    TrainerSync,
)
from shardplan.transport import Control, PeerAborted, PeerDied, PeerTimeout, consumer_name, create, trainer_name

TIMEOUT_S = 2.0
PART_BYTES = 2048  # PlanWorld moves each decoder layer in parts of at most this many bytes


# ---- stand-in world: pack = copy byte ranges of source tensors; apply = keep the bytes -------------------------------
@dataclass
class StandInWorld:
    """3 decoder-layer groups + head; each consumer gets a 1/num_consumers byte slice of every tensor plus one
    replicated tensor per group. Trainer 0 holds everything whole; the others hold everything but layers.0 whole
    (layers.0 they hold only half of: a partial box the scheduler must not use)."""

    num_trainers: int = 2
    num_consumers: int = 4
    num_layers: int = 3
    seed: int = 0
    tensors: dict = field(default_factory=dict)
    spans: dict = field(default_factory=dict)  # consumer -> group -> [Span]
    picks: dict = field(default_factory=dict)  # (consumer, group) -> [(source name, start byte)]

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self.groups = [f"layers.{i}" for i in range(self.num_layers)] + ["head"]
        for group in self.groups:
            for w in range(3):
                n = int(torch.randint(4000, 12000, (1,), generator=g))
                dtype = torch.bfloat16 if w % 2 else torch.float32
                self.tensors[f"model.{group}.w{w}"] = torch.randn(n, generator=g).to(dtype)
        for c in range(self.num_consumers):
            self.spans[c] = {}
            for group in self.groups:
                segs, picks, offset = [], [], 0
                for w in range(3):
                    name = f"model.{group}.w{w}"
                    total = self.tensors[name].numel() * self.tensors[name].element_size()
                    nbytes, start = (
                        (total, 0) if w == 2 else (total // self.num_consumers, c * (total // self.num_consumers))
                    )
                    segs.append(Span(offset, nbytes, (name,)))
                    picks.append((name, start))
                    offset = (offset + nbytes + 255) // 256 * 256
                self.spans[c][group] = segs
                self.picks[(c, group)] = picks

    def holds_whole(self, rank: int, name: str) -> bool:
        return rank == 0 or ".layers.0." not in name

    def packer(self, rank: int) -> "StandInPacker":
        return StandInPacker(self)

    def source(self, rank: int) -> "StandInSource":
        return StandInSource(self, rank)

    def unpacker(self, rank: int) -> "StandInUnpacker":
        return StandInUnpacker(self, rank)

    def expected(self, c: int, group: str) -> dict[int, bytes]:
        """Span offset -> the bytes the consumer must receive there."""
        out = {}
        for seg, (name, start) in zip(self.spans[c][group], self.picks[(c, group)]):
            raw = self.tensors[name].view(-1).view(torch.uint8)
            out[seg.offset] = bytes(raw[start : start + seg.nbytes].numpy())
        return out


class StandInSource:
    def __init__(self, world: StandInWorld, rank: int):
        self.world, self.rank = world, rank

    def metadata(self):
        return {n: TensorMeta(n, tuple(t.shape), str(t.dtype)[6:]) for n, t in self.world.tensors.items()}

    def boxes(self):
        return {
            n: ((0, t.shape[0]),) if self.world.holds_whole(self.rank, n) else ((0, t.shape[0] // 2),)
            for n, t in self.world.tensors.items()
        }

    def group(self, group: str):
        return {
            n: t for n, t in self.world.tensors.items() if f".{group}." in n and self.world.holds_whole(self.rank, n)
        }


class StandInPacker:
    def __init__(self, world: StandInWorld):
        self.world = world
        self.stall_at: str | None = None  # fault: sleep "forever" when packing this group
        self.fail_at: str | None = None  # fault: raise when packing this group

    def consumers(self):
        return range(self.world.num_consumers)

    def groups(self):
        return self.world.groups

    def spans(self, consumer, group):
        return self.world.spans[consumer][group]

    def stamp(self, consumer):
        return f"rank{consumer}:{len(self.world.spans[consumer])}"

    def pack(self, consumer, group, tensors, out, segments):
        if group == self.stall_at:
            time.sleep(3600)
        if group == self.fail_at:
            raise RuntimeError(f"the trainer's source failed while packing {group}")
        layout, picks = self.world.spans[consumer][group], self.world.picks[(consumer, group)]
        for i in segments:
            seg, (name, start) = layout[i], picks[i]
            raw = tensors[name].view(-1).view(torch.uint8)
            out[seg.offset : seg.offset + seg.nbytes].copy_(raw[start : start + seg.nbytes])


class StandInUnpacker:
    def __init__(self, world: StandInWorld, rank: int):
        self.world, self.rank = world, rank
        self.received: dict[str, dict[int, bytes]] = {}
        self.die_at: str | None = None  # fault: the process exits while applying this group

    def sizes(self):
        return {g: max(s.offset + s.nbytes for s in segs) for g, segs in self.world.spans[self.rank].items()}

    def stamp(self):
        return f"rank{self.rank}:{len(self.world.spans[self.rank])}"

    def apply(self, group, buffer):
        if group == self.die_at:
            os._exit(17)
        self.received[group] = {
            s.offset: bytes(buffer[s.offset : s.offset + s.nbytes].numpy()) for s in self.world.spans[self.rank][group]
        }


# ---- real-plan worlds: shardplan.runtime's replay / apply / shards behind the engine's adapters ----------------
def tiny_llama_plans(num_consumers: int = 2, hidden: int = 64, num_layers: int = 2, vocab: int = 96):
    """Plans shaped like vLLM's Llama loader at TP=num_consumers: fused qkv rows, o_proj columns, replicated norms,
    lm_head rows. Returns (plans, sources)."""
    from shardplan.plan import ir

    h, shard = hidden, hidden // num_consumers
    sources, plans = {}, []

    def src(name, shape, dtype="bfloat16"):
        sources[name] = ir.TensorMeta(name, tuple(shape), dtype)
        return name

    for r in range(num_consumers):
        params, writes = [], []
        for layer in range(num_layers):
            pre = f"model.layers.{layer}"
            qkv = f"{pre}.self_attn.qkv_proj.weight"
            params.append(ir.TensorMeta(qkv, (3 * shard, h), "bfloat16"))
            for j, name in enumerate("qkv"):
                s = src(f"{pre}.self_attn.{name}_proj.weight", (h, h))
                writes.append(
                    ir.Write(
                        qkv,
                        ir.Region(j * shard * h, (shard, h), (h, 1)),
                        ir.View(ir.Source(s), ir.Region(r * shard * h, (shard, h), (h, 1))),
                    )
                )
            o = f"{pre}.self_attn.o_proj.weight"
            params.append(ir.TensorMeta(o, (h, shard), "bfloat16"))
            s = src(o, (h, h))
            writes.append(
                ir.Write(o, ir.full_region((h, shard)), ir.View(ir.Source(s), ir.Region(r * shard, (h, shard), (h, 1))))
            )
            norm = f"{pre}.input_layernorm.weight"
            params.append(ir.TensorMeta(norm, (h,), "float32"))
            s = src(norm, (h,), "float32")
            writes.append(ir.Write(norm, ir.full_region((h,)), ir.View(ir.Source(s), ir.full_region((h,)))))
        head, rows = "lm_head.weight", vocab // num_consumers
        params.append(ir.TensorMeta(head, (rows, h), "bfloat16"))
        s = src(head, (vocab, h))
        writes.append(
            ir.Write(head, ir.full_region((rows, h)), ir.View(ir.Source(s), ir.Region(r * rows * h, (rows, h), (h, 1))))
        )
        plans.append(ir.RankPlan(r, tuple(params), tuple(writes)))
    return plans, sources


def full_tensors(sources, seed: int = 0) -> dict[str, torch.Tensor]:
    from shardplan.plan.interp import to_dtype

    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(m.shape, generator=g).to(to_dtype(m.dtype)) for n, m in sorted(sources.items())}


class Received:
    """Unpacker wrapper that exposes the consumer's params as `received` (what the tests compare)."""

    def __init__(self, inner, params):
        self.inner, self.received = inner, params

    def sizes(self):
        return self.inner.sizes()

    def apply(self, group, buffer):
        self.inner.apply(group, buffer)

    def stamp(self):
        return self.inner.stamp()


class ReceivedInPlace(Received):
    """Received, plus what the engine backend's unpacker does with the sync's `receive_targets`: every segment
    Applier.in_place_segments allows is received straight into its param (here the params exist all along), and
    apply skips it. `in_place_bytes`: how many bytes landed so."""

    def __init__(self, inner, params, alternate: bool = False):
        super().__init__(inner, params)
        self.skip: dict[str, frozenset[int]] = {}
        self.in_place_bytes = 0
        self.refuse = itertools.cycle([False, True] if alternate else [False])  # every other one through the buffer

    def receive_targets(self, group, spans):
        layout = self.inner.layout
        if group not in layout.group_names:
            return [None] * len(spans)
        found = self.inner.applier.for_group(group).in_place_segments()
        out = []
        for lo, hi in spans:
            name, first, numel = found.get(lo, (None, 0, 0))
            if next(self.refuse):
                name = None
            view = None if name is None else self.received[name].view(-1)[first : first + numel].view(torch.uint8)
            out.append(view if view is not None and view.numel() == hi - lo else None)
        self.skip[group] = frozenset(lo for (lo, _), v in zip(spans, out) if v is not None)
        self.in_place_bytes += sum(v.numel() for v in out if v is not None)
        return out

    def apply(self, group, buffer):
        if group in self.inner.layout.group_names:
            self.inner.applier.for_group(group).apply(buffer[: self.inner.layout.group(group).nbytes], self.skip[group])


class FullSource:
    """Trainer holding full tensors (a replicated trainer, or one that gathered them)."""

    def __init__(self, tensors, boxes=None):
        self.tensors = tensors

    def metadata(self):
        return {n: TensorMeta(n, tuple(t.shape), str(t.dtype)[6:]) for n, t in self.tensors.items()}

    def boxes(self):
        return {n: tuple((0, s) for s in t.shape) for n, t in self.tensors.items()}

    def group(self, group):
        return {n: t for n, t in self.tensors.items() if group_of(n) == group}


@dataclass
class PlanWorld:
    """Real plans through ReplayPacker / ApplyUnpacker: 2 replicated trainers -> TP2 consumers."""

    num_trainers: int = 2
    num_consumers: int = 2
    direct_bytes: int | None = 1024  # segments sent from the trainer's tensors (small: the tiny plans' qkv rows are)
    refuse_direct: bool = False  # the packer gives no view of every other segment: those are packed instead
    in_place: str = ""  # "all" / "alternate": consumers receive what they can (or every other such message) straight
    # into their params (ReceivedInPlace)

    def __post_init__(self):
        from shardplan.sync import ReplayPacker, spans_of

        self.plans, self.sources = tiny_llama_plans(self.num_consumers)
        self.tensors = full_tensors(self.sources)
        # small parts: every decoder layer's group is moved in several parts (PackLayout's max_group_bytes)
        self._packer = ReplayPacker(
            self.plans, self.sources, max_group_bytes=PART_BYTES, direct_bytes=self.direct_bytes
        )
        if self.refuse_direct:
            view, calls = self._packer.direct_view, itertools.count()
            self._packer.direct_view = lambda c, g, t, seg: None if next(calls) % 2 else view(c, g, t, seg)
        self.groups, self.spans = list(self._packer.groups()), spans_of(self._packer)
        assert any("/" in g for g in self.groups), "the parts path is not exercised"

    def packer(self, rank):
        return self._packer

    def source(self, rank):
        return FullSource(self.tensors)

    def unpacker(self, rank):
        from shardplan.runtime.apply import params_from_plan
        from shardplan.sync import ApplyUnpacker

        params = params_from_plan(self.plans[rank], fill=float("nan"))
        unpacker = ApplyUnpacker(self.plans[rank], params, max_group_bytes=PART_BYTES)
        if self.in_place:
            return ReceivedInPlace(unpacker, params, alternate=self.in_place == "alternate")
        return Received(unpacker, params)

    def reference(self, rank):
        from shardplan.plan.interp import apply_reference
        from shardplan.runtime.apply import params_from_plan

        params = params_from_plan(self.plans[rank], fill=float("nan"))
        apply_reference(self.plans[rank], self.tensors, params)
        return params


@dataclass
class FallbackWorld(PlanWorld):
    """PlanWorld whose plans have fallback tensors (loaders that could not be recorded): layer 1's o_proj (its layer
    has replayed bytes too, so it rides after them in the layer's last part) and a tensor of a layer no write reads
    (a group of its own). Each consumer's fallback loader keeps what it gets, as `fallback:<name>` in `received`."""

    def __post_init__(self):
        from shardplan.plan import ir
        from shardplan.sync import ReplayPacker, spans_of

        plans, self.sources = tiny_llama_plans(self.num_consumers)
        self.sources["model.layers.5.mixer.A_log"] = ir.TensorMeta("model.layers.5.mixer.A_log", (24,), "float32")
        self.fallback_names = ("model.layers.1.self_attn.o_proj.weight", "model.layers.5.mixer.A_log")
        self.plans = []
        for plan in plans:
            writes = tuple(w for w in plan.writes if w.src.leaf != ir.Source(self.fallback_names[0]))
            fallbacks = tuple(
                ir.Fallback(n, "torch.exp", "stand-in for an unrecordable loader", "test") for n in self.fallback_names
            )
            self.plans.append(ir.RankPlan(plan.rank, plan.params, writes, fallbacks, plan.not_needed))
        self.tensors = full_tensors(self.sources)
        self._packer = ReplayPacker(self.plans, self.sources, max_group_bytes=PART_BYTES)
        self.groups, self.spans = list(self._packer.groups()), spans_of(self._packer)
        assert "layers.5" in self.groups

    def unpacker(self, rank):
        from shardplan.runtime.apply import params_from_plan
        from shardplan.sync import ApplyUnpacker

        params = params_from_plan(self.plans[rank], fill=float("nan"))

        def loader(name, tensor):
            params[f"fallback:{name}"] = tensor

        return Received(
            ApplyUnpacker(
                self.plans[rank], params, max_group_bytes=PART_BYTES, sources=self.sources, fallback_loader=loader
            ),
            params,
        )

    def reference(self, rank):
        params = super().reference(rank)
        params.update({f"fallback:{n}": self.tensors[n] for n in self.fallback_names})
        return params


@dataclass
class ShardedWorld(PlanWorld):
    """Trainers hold TP2 row shards of every 2-D tensor (norms replicated); consumers are TP2 with column-split
    o_proj: bytes come as box intersections (shardplan.runtime.shards) through ShardedPacker / ShardedUnpacker."""

    def __post_init__(self):
        from shardplan.runtime.shards import local_tensors, plan_shards, tp_shards
        from shardplan.sync import ShardedPacker, spans_of

        self.plans, self.sources = tiny_llama_plans(self.num_consumers)
        self.tensors = full_tensors(self.sources)
        self.shards = tp_shards(
            self.sources, self.num_trainers, lambda n: 0 if len(self.sources[n].shape) == 2 else None
        )
        self.sharded = plan_shards(self.plans, self.sources, self.shards)
        self.local = {t: local_tensors(self.shards, t, self.tensors) for t in range(self.num_trainers)}
        first = ShardedPacker(self.sharded, 0)
        self.groups, self.spans = list(first.groups()), spans_of(first)

    def packer(self, rank):
        from shardplan.sync import ShardedPacker

        return ShardedPacker(self.sharded, rank)

    def source(self, rank):
        return FullSource(self.local[rank])  # local shards under the full names; `only` pins segments to ranks

    def unpacker(self, rank):
        from shardplan.runtime.apply import params_from_plan
        from shardplan.sync import ShardedUnpacker

        params = params_from_plan(self.plans[rank], fill=float("nan"))
        return Received(ShardedUnpacker(self.sharded, rank, params), params)


# ---- rank construction and remote helpers (module level: picklable for spawn and Ray) --------------------------------
def build_rank(world_factory, name: str, transport, control: Control, config: SyncConfig | None = None):
    world = world_factory()
    config = config or SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=60)
    if name.startswith("trainer"):
        rank = int(name[7:])
        return TrainerSync(rank, world.packer(rank), world.source(rank), transport, control, config)
    rank = int(name[8:])
    return ConsumerSync(rank, world.unpacker(rank), transport, control, config)


def received(engine) -> dict:
    return engine.unpacker.received


def in_place_bytes(engine) -> int:
    return engine.unpacker.in_place_bytes


def state(engine) -> SyncState:
    return engine.state


def arm_stall(engine, group: str) -> None:
    engine.packer.stall_at = group


def arm_amax_stall(engine) -> None:
    """Fault: a trainer whose boxes cut quantization blocks stalls before publishing its block amaxes."""
    engine.packer.partial_amaxes = lambda group, tensors: time.sleep(3600)


def arm_amax_delay(engine, group: str, seconds: float) -> None:
    """Slow: a trainer's partial block amaxes of `group` come `seconds` late (a holder behind by one layer)."""
    partial = engine.packer.partial_amaxes

    def late(g, tensors):
        if g == group:
            time.sleep(seconds)
        return partial(g, tensors)

    engine.packer.partial_amaxes = late


def record_events(engine) -> None:
    """Keep this rank process's sync events (sync.stages.event: "send 3 posted", ...) with their times."""
    from shardplan.sync import set_event_listener

    engine.events = []
    set_event_listener(lambda name: engine.events.append((time.monotonic(), name)))


def recorded_events(engine) -> list[tuple[float, str]]:
    return list(engine.events)


def arm_failure(engine, group: str) -> None:
    engine.packer.fail_at = group


def arm_death(engine, group: str) -> None:
    engine.unpacker.die_at = group


def arm_corruption(engine, group_index: int) -> None:
    """Flip one byte of the first piece this consumer receives for group `group_index` (version after arming), after
    the transport delivered it and before the consumer checksums it: what a bad link or a stray write would do."""
    recv, armed = engine.transport.recv, [True]

    class Flipping:
        def __init__(self, pending, buf):
            self.pending, self.buf = pending, buf

        def wait(self, *args, **kwargs):
            out = self.pending.wait(*args, **kwargs)
            self.buf.view(torch.uint8)[0] ^= 1
            return out

    def corrupting_recv(peer, buf, tag):
        pending = recv(peer, buf, tag)
        if armed[0] and tag.group == group_index and tag.nbytes > 0:
            armed[0] = False
            return Flipping(pending, buf)
        return pending

    engine.transport.recv = corrupting_recv


def _rank_main(name, transport_name, control, build, conn, timeout_s=TIMEOUT_S):
    try:
        transport = create(transport_name, me=name, control=control, device="cpu", timeout_s=timeout_s)
        engine = build(name, transport, control)
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        conn.send(("error", e))
        return
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            transport.close()
            conn.send(("ok", None))
            return
        try:
            out = engine.sync(arg) if cmd == "sync" else arg[0](engine, *arg[1:])
            conn.send(("ok", out))
        except BaseException as e:  # noqa: BLE001 - reported to the driver
            conn.send(("error", e))


def spawn_context():
    """forkserver with torch preloaded: a rank starts in ~0.1 s instead of ~3 s (x6 ranks on a 2-core box)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardplan.sync", "shardplan.transport.nccl", __name__])
    return ctx


def cluster_setup(cluster, transport: str, world_factory, config: SyncConfig | None) -> None:
    """What LocalCluster and RayCluster share: the world, the control store, the coordinator, the rank names."""
    world = world_factory()
    cluster.transport, cluster.world = transport, world
    cluster.config = config or SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=60)
    cluster.control = Control.serve("127.0.0.1")
    cluster.build = functools.partial(build_rank, world_factory, config=cluster.config)
    cluster.coordinator = Coordinator(
        cluster.control,
        world.spans,
        world.groups,
        world.num_trainers,
        cluster.config,
        eplb=getattr(world, "eplb", None),
    )
    cluster.names = [trainer_name(t) for t in range(world.num_trainers)] + [
        consumer_name(c) for c in range(world.num_consumers)
    ]


class LocalCluster:
    """Ranks as spawned processes on 127.0.0.1; this process hosts the control store and the coordinator.
    `sync(version)` -> {rank: ("ok", SyncReport) | ("error", exception) | ("died", None) | ("hung", None)}."""

    def __init__(self, transport: str, world_factory, config: SyncConfig | None = None):
        cluster_setup(self, transport, world_factory, config)
        self.ctx = spawn_context()
        self.procs: dict[str, tuple] = {}
        for name in self.names:
            self._spawn(name)
        for name in self.names:
            self._ready(name)

    def _spawn(self, name):
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_rank_main,
            args=(name, self.transport, self.control, self.build, child, self.config.timeout_s),
            daemon=True,
        )
        proc.start()
        self.procs[name] = (proc, parent)

    def _ready(self, name):
        proc, conn = self.procs[name]
        if not conn.poll(120):
            raise TimeoutError(f"{name} did not start")
        tag, err = conn.recv()
        if tag != "ready":
            raise err

    def restart(self, name):
        self.kill(name)
        self._spawn(name)
        self._ready(name)

    def kill(self, name):
        proc, _ = self.procs[name]
        if proc.is_alive():
            proc.kill()
        proc.join(10)

    def call(self, name, fn, *args):
        _, conn = self.procs[name]
        conn.send(("call", (fn, *args)))
        if not conn.poll(60):
            raise TimeoutError(f"{name} did not answer")
        tag, out = conn.recv()
        if tag == "error":
            raise out
        return out

    def sync(self, version: int, wait_s: float = 30.0) -> dict:
        ann = self.coordinator.announce(version)
        members = [n for n in self.names if n in ann.members]
        start = time.monotonic()
        for name in members:
            self.procs[name][1].send(("sync", version))
        out, deadline, self.seconds = {}, start + wait_s, {}
        while len(out) < len(members):
            for name in members:
                proc, conn = self.procs[name]
                if name in out:
                    continue
                if conn.poll(0):
                    try:
                        out[name] = conn.recv()
                    except EOFError:
                        out[name] = ("died", None)
                elif not proc.is_alive():
                    out[name] = ("died", None)
                elif time.monotonic() > deadline:
                    out[name] = ("hung", None)
                if name in out:
                    self.seconds[name] = time.monotonic() - start
            time.sleep(0.01)
        return out

    def close(self):
        for name, (proc, conn) in self.procs.items():
            if proc.is_alive():
                proc.kill()
            proc.join(5)


class RayCluster:
    """Ranks as Ray actors (shardplan.transport.rdt.sync_actor); same interface as LocalCluster. Needs ray.init()."""

    def __init__(self, transport: str, world_factory, config: SyncConfig | None = None):
        import ray

        from shardplan.transport.rdt import router_actor

        self.ray = ray
        cluster_setup(self, transport, world_factory, config)
        self.router = None if transport == "rdt:nixl" else router_actor().remote()
        self.actors = {n: self._new_actor(n) for n in self.names}
        ray.get([a.start.remote(self.actors, self.router) for a in self.actors.values()], timeout=120)
        self.grouped: list | None = None
        self.stacks = ""  # thread stacks of every actor after a sync that did not come back ok
        self.failed_last = False

    def _new_actor(self, name):
        from shardplan.transport.rdt import sync_actor

        return sync_actor().remote(name, self.transport, self.control, self.build, self.config.timeout_s)

    def restart(self, name):
        self.kill(name)
        self.actors[name] = self._new_actor(name)
        self.ray.get(self.actors[name].start.remote(self.actors, self.router), timeout=120)
        for other, actor in self.actors.items():  # the others learn the new handle
            if other != name:
                try:
                    self.ray.get(actor.call.remote(_set_handle, name, self.actors[name]), timeout=30)
                except self.ray.exceptions.RayActorError:
                    pass

    def kill(self, name):
        self.ray.kill(self.actors[name])

    def call(self, name, fn, *args):
        return self.ray.get(self.actors[name].call.remote(fn, *args), timeout=60)

    def sync(self, version: int, wait_s: float = 30.0) -> dict:
        ray = self.ray
        ann = self.coordinator.announce(version)
        members = [n for n in self.names if n in ann.members]
        group = [(n, self.actors[n]._actor_id.hex()) for n in members]
        if self.router is not None and (group != self.grouped or self.failed_last):
            # collectives: the group must hold exactly the live members (Ray: one group per backend per actor), and
            # Ray destroys it after any failed transfer
            ray.get(self.router.regroup.remote([self.actors[n] for n in members], self.transport[4:]), timeout=120)
            self.grouped = group
        start = time.monotonic()
        refs = {n: self.actors[n].sync.remote(version) for n in members}
        out, deadline, self.seconds = {}, start + wait_s, {}
        pending = dict(refs)
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(deadline - time.monotonic(), 0.01))
            for name in [n for n, r in pending.items() if r in ready]:
                try:
                    out[name] = ("ok", ray.get(pending.pop(name)))
                except ray.exceptions.RayActorError:
                    out[name] = ("died", None)
                except ray.exceptions.RayTaskError as e:
                    out[name] = ("error", e.cause if getattr(e, "cause", None) is not None else e)
                self.seconds[name] = time.monotonic() - start
        out.update({name: ("hung", None) for name in pending})
        self.failed_last = any(r[0] != "ok" for r in out.values())
        self.stacks = self.thread_stacks() if self.failed_last else ""
        return out

    def thread_stacks(self) -> str:
        """Every thread's stack in every rank actor and the router, Ray's `_ray_system` transfer thread included: a
        sync that did not come back ok says where each side waits (a CI hang is otherwise a bare timeout)."""
        handles = {**self.actors, **({"router": self.router} if self.router is not None else {})}
        refs = {n: a.__ray_call__.remote(_stacks_here) for n, a in handles.items()}
        ready, _ = self.ray.wait(list(refs.values()), num_returns=len(refs), timeout=10)
        out = []
        for name, ref in refs.items():
            try:
                out.append(f"==== {name}\n{self.ray.get(ref, timeout=0) if ref in ready else 'no answer in 10 s'}")
            except Exception as e:  # noqa: BLE001 - a dead actor: say so and go on
                out.append(f"==== {name}: no stacks ({type(e).__name__})")
        return "\n".join(out)

    def close(self):
        for actor in self.actors.values():
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        if self.router is not None:
            self.ray.kill(self.router)


def _stacks_here(actor) -> str:
    import sys
    import threading
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames().items()
    return "\n".join(f"-- {names.get(i, i)}\n{''.join(traceback.format_stack(f)[-8:])}" for i, f in frames)


def _set_handle(engine, name, handle):
    engine.transport.handles[name] = handle


EQUALITY_TIMEOUT_S = 20.0  # run_sync proves bytes, not fault timing: a loaded CI box must not fail it by a timeout


def run_sync(world_factory, transport: str, version: int = 1, config: SyncConfig | None = None, read=None) -> dict:
    """One whole sync of `world_factory()` over `transport`; {consumer rank: read(consumer engine)} (default
    `received`: {group: {offset: bytes}}). rdt:* transports need ray.init() first. Timeouts are EQUALITY_TIMEOUT_S
    unless `config` says (the fault scenarios keep TIMEOUT_S); the driver waits for the ranks long enough that a
    timed-out rank reports its own error instead of 'hung'.

    Ray RDT's gloo path once left one transfer unfinished in CI (every other rank done; the trainer's lock on the
    router held; not reproduced here, docs/transports.md): on rdt:* a sync that failed by timeouts alone is run once
    more on fresh actors, after a warning that carries every actor's thread stacks. Bytes are still proven bitwise by
    the second sync; any other failure, and a second timeout, fail the test."""
    config = config or SyncConfig(timeout_s=EQUALITY_TIMEOUT_S, announce_timeout_s=60)
    read = read or received
    ray_rdt = transport.startswith("rdt:")
    for attempt in (1, 2) if ray_rdt else (1,):
        cluster = (RayCluster if ray_rdt else LocalCluster)(transport, world_factory, config)
        try:
            results = cluster.sync(version, wait_s=2 * config.timeout_s + 10)  # a trainer's ack wait is 1.5x
            bad = {n: r for n, r in results.items() if r[0] != "ok"}
            if bad and attempt == 1 and ray_rdt and all(_timed_out(r) for r in bad.values()):
                warnings.warn(f"{transport}: sync timed out, run again on fresh actors: {bad}\n{cluster.stacks}")
                continue
            if bad:
                raise AssertionError(f"sync failed: {bad}\n{getattr(cluster, 'stacks', '')}")
            world = cluster.world
            return {c: cluster.call(consumer_name(c), read) for c in range(world.num_consumers)}
        finally:
            cluster.close()
    raise AssertionError("unreachable")


def _timed_out(result) -> bool:
    """A rank's sync result that is a timeout and nothing else ('hung', or every failed peer a PeerTimeout/abort)."""
    kind, err = result
    if kind == "hung":
        return True
    return (
        kind == "error"
        and isinstance(err, SyncFailed)
        and all(isinstance(e, (PeerTimeout, PeerAborted)) for e in err.failures.values())
    )


# ---- checks ----------------------------------------------------------------------------------------------------------
def assert_bitwise(cluster, consumers) -> None:
    for c in consumers:
        got = cluster.call(consumer_name(c), received)
        for group in cluster.world.groups:
            assert got[group] == cluster.world.expected(c, group), f"consumer{c} {group}: bytes differ"


def scenario(cluster, *, stall: bool) -> None:
    """v1 clean; v2 consumer2 dies mid-sync; v3 it rejoins; (stall) v4 trainer1 stalls, v5 runs without it."""
    world = cluster.world
    everyone = range(world.num_consumers)
    # v1: every consumer gets exactly what the trainers packed
    results = cluster.sync(1)
    assert all(r[0] == "ok" for r in results.values()), results
    assert sum(r[1].nbytes for n, r in results.items() if n.startswith("trainer")) == sum(
        r[1].nbytes for n, r in results.items() if n.startswith("consumer")
    )
    assert_bitwise(cluster, everyone)
    assert all(cluster.call(consumer_name(c), state) == (1, True) for c in everyone)

    # v2: consumer2 dies while applying layers.1: the others complete, the trainers name it, nothing hangs
    cluster.call("consumer2", arm_death, "layers.1")
    results = cluster.sync(2)
    assert results["consumer2"][0] == "died", results
    assert max(cluster.seconds.values()) < 2 * TIMEOUT_S + 3  # nobody waited longer than its timeout
    killed = {n for n, r in results.items() if r[0] == "died" and n.startswith("trainer")}
    if killed:
        # Ray 2.60 kills BOTH actors of a failed collective RDT transfer (rdt:gloo / rdt:nccl, docs/transports.md):
        # a trainer that was sending to consumer2 when it died goes down with it
        assert cluster.transport in ("rdt:gloo", "rdt:nccl"), results
    trainer_errors = {n: r[1] for n, r in results.items() if n.startswith("trainer") and r[0] == "error"}
    assert killed or trainer_errors, results  # someone had bytes for consumer2 after its death and says so
    for name, err in trainer_errors.items():
        assert isinstance(err, SyncFailed) and set(err.failures) == {"consumer2"}, err
        assert isinstance(err.failures["consumer2"], (PeerDied, PeerTimeout)), err
    survivors = [c for c in (0, 1, 3) if results[consumer_name(c)][0] == "ok"]
    for c in (0, 1, 3):
        if c not in survivors:  # only possible when Ray took a trainer down: it names that trainer
            err = results[consumer_name(c)][1]
            assert killed and isinstance(err, SyncFailed) and set(err.failures) <= killed, results
            assert cluster.call(consumer_name(c), state) == (2, False)
    assert survivors and (killed or survivors == [0, 1, 3]), results
    assert_bitwise(cluster, survivors)
    assert all(cluster.call(consumer_name(c), state) == (2, True) for c in survivors)
    # its version is incomplete: it wrote no result, so the coordinator leaves it out of the next version
    assert "consumer2" not in cluster.coordinator.results(2, 0.1)

    # v3: a fresh consumer2 (and any trainer Ray took down) join with new epochs and take part at once
    for name in ["consumer2", *sorted(killed)]:
        cluster.restart(name)
    assert cluster.call("consumer2", state) == (0, True)
    results = cluster.sync(3)
    assert all(r[0] == "ok" for r in results.values()), results
    assert set(results) == set(cluster.names)
    assert_bitwise(cluster, everyone)
    assert all(cluster.call(consumer_name(c), state) == (3, True) for c in everyone)
    if not stall:
        return

    # v4: trainer1 stalls while packing layers.2: consumers it serves time out naming it, within the timeout
    cluster.call("trainer1", arm_stall, "layers.2")
    results = cluster.sync(4, wait_s=2 * TIMEOUT_S + 2)
    assert results["trainer1"][0] == "hung", results
    failed = [c for c in everyone if results[consumer_name(c)][0] == "error"]
    assert failed, results
    for c in failed:
        err = results[consumer_name(c)][1]
        assert isinstance(err, SyncFailed) and "trainer1" in err.failures, err
        assert isinstance(err.failures["trainer1"], PeerTimeout)
        assert cluster.call(consumer_name(c), state) == (4, False)  # layers.0/1 of v4 applied, layers.2 not
    assert max(cluster.seconds[consumer_name(c)] for c in failed) < 2 * TIMEOUT_S + 2  # bounded by the timeout
    tag, err = results["trainer0"]
    if tag == "error":  # its lanes to the failed consumers ended at once, naming the culprit
        assert isinstance(err, SyncFailed), err
        assert all(isinstance(e, PeerAborted) and "trainer1" in str(e) for e in err.failures.values()), err
    else:
        assert tag == "ok", results

    # v5: the coordinator leaves the silent trainer1 out; trainer0 (which holds everything) serves all bytes
    results = cluster.sync(5)
    assert "trainer1" not in results
    assert all(r[0] == "ok" for r in results.values()), results
    assert_bitwise(cluster, everyone)
    assert all(cluster.call(consumer_name(c), state) == (5, True) for c in everyone)
