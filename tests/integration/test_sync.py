"""Sync engine tests: schedule units, then whole syncs 2 trainers -> 4 consumers over every CPU transport, with faults
(the worlds and clusters: tests/integration/sync_worlds.py)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import pytest
import torch
from sync_worlds import (
    PART_BYTES,
    FallbackWorld,
    FullSource,
    LocalCluster,
    PlanWorld,
    RayCluster,
    ShardedWorld,
    StandInWorld,
    arm_corruption,
    arm_failure,
    assert_bitwise,
    full_tensors,
    in_place_bytes,
    received,
    run_sync,
    scenario,
    state,
)
from tiny_models import tiny

from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.names import group_of
from shardplan.runtime.apply import FallbackRequiredError
from shardplan.sync import (
    ChecksumMismatch,
    ConsumerSync,
    Coordinator,
    LayoutMismatch,
    NotAMember,
    Schedule,
    ScheduleError,
    Span,
    SyncConfig,
    SyncConfigError,
    SyncFailed,
    build_schedule,
    checksum,
)
from shardplan.transport import Control, PeerAborted, consumer_name, trainer_name


# ---- unit tests ------------------------------------------------------------------------------------------------------
def _held(world, trainers):
    return {t: frozenset(n for n in world.tensors if world.holds_whole(t, n)) for t in trainers}


def test_schedule_covers_every_byte_once_and_respects_holdings():
    world = StandInWorld()
    sched = build_schedule(world.spans, world.groups, _held(world, (0, 1)), (0, 1), range(4))
    for c in range(4):
        for gi, group in enumerate(world.groups):
            segs = world.spans[c][group]
            covered = sorted(i for p in sched.of(c, gi) for i in p.segments)
            assert covered == list(range(len(segs)))
            pieces = sched.of(c, gi)
            assert all(a.hi <= b.lo for a, b in zip(pieces, pieces[1:]))  # byte order, no overlap
            for p in pieces:
                assert (
                    p.lo == segs[p.segments[0]].offset
                    and p.hi == segs[p.segments[-1]].offset + segs[p.segments[-1]].nbytes
                )
                if group == "layers.0":
                    assert p.trainer == 0  # only trainer0 holds layers.0 whole
    load = sched.bytes_by_trainer()
    total = sum(load.values())
    # layers.0 must all go to trainer0; the rest is balanced so the two end within one group of each other
    assert min(load.values()) > 0.3 * total
    assert Schedule.from_json(sched.to_json()) == sched


def test_schedule_balances_per_group_and_splits_when_more_trainers_than_consumers():
    spans = {0: {"g": [Span(i * 1024, 1024, (f"t{i}",)) for i in range(8)]}}
    sched = build_schedule(spans, ["g"], {0: None, 1: None, 2: None, 3: None}, (0, 1, 2, 3), (0,))
    assert sorted(sched.bytes_by_trainer().values()) == [2048] * 4
    assert [p.trainer for p in sched.of(0, 0)] and len(sched.of(0, 0)) == 4


def test_schedule_names_a_tensor_nobody_holds():
    world = StandInWorld()
    with pytest.raises(ScheduleError, match=r"consumer0, group layers.0: no live trainer holds .*model.layers.0.w0"):
        build_schedule(world.spans, world.groups, _held(world, (1,)), (1,), range(4))


def test_checksum_sees_a_changed_byte_and_works_unaligned():
    buf = torch.arange(1000, dtype=torch.int64).view(torch.uint8)
    a = checksum(buf[3:3001])
    other = buf.clone()
    other[100] += 1
    assert checksum(other[3:3001]) != a
    assert checksum(buf[3:3001].clone()) == a  # the bytes decide, not their alignment
    assert checksum(buf[:0]) == 0


def test_checksum_sees_changed_bytes_zeroed_words_and_cut_tails():
    """A changed byte anywhere, a zeroed word or a cut tail changes it (swapped words and compensating changes:
    tests/unit/test_checksum.py, with the function's definition)."""
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (8 * 10000 + 5,), dtype=torch.uint8, generator=g)
    for at in (0, 7, 4003, 8004, 80004):
        other = buf.clone()
        other[at] ^= 1
        assert checksum(other) != checksum(buf), at
    zeroed = buf.clone()
    zeroed[800:808] = 0
    assert checksum(zeroed) != checksum(buf) or not buf[800:808].any()
    assert checksum(buf[:80000]) != checksum(buf)


@pytest.mark.parametrize(
    "field, value",
    [
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("timeout_s", float("nan")),
        ("timeout_s", float("inf")),
        ("timeout_s", "5"),
        ("timeout_s", True),
        ("timeout_s", None),
        ("announce_timeout_s", float("nan")),
        ("announce_timeout_s", "600"),
        ("verify", "yes"),
        ("verify", 1),
    ],
)
def test_config_refuses_bad_numbers_by_name(field, value):
    # NaN used to pass and fail later with "cannot convert float NaN to integer"
    with pytest.raises(SyncConfigError, match=f"SyncConfig: {field} must be"):
        SyncConfig(**{field: value})
    assert SyncConfig(timeout_s=5, announce_timeout_s=0.5).timeout_s == 5


def test_control_connect_honours_its_timeout():
    """A wrong control port (nothing listening): every connect is bounded by connect_timeout_s and named; it used
    to retry for 60 s per client (~95 s for the engine's prewarm of 4, 135 s in a live engine's init)."""
    import socket

    from shardplan.transport.base import ControlUnreachable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ControlUnreachable, match=rf"control channel at 127.0.0.1:{port} within 1.0 s"):
        Control("127.0.0.1", port, connect_timeout_s=1.0).prewarm(4)
    assert time.monotonic() - t0 < 10  # one bounded connect, not four (generous: a loaded 2-core box)
    with pytest.raises(ValueError, match="connect_timeout_s"):
        Control("127.0.0.1", port, connect_timeout_s=float("nan"))
    served = Control.serve("127.0.0.1")
    import pickle

    again = pickle.loads(pickle.dumps(Control(served.host, served.port, connect_timeout_s=2.5, secret=served.secret)))
    assert again.connect_timeout_s == 2.5 and again.secret == served.secret
    again.set("k", "v")
    assert served.try_get("k") == "v"


def test_coordinator_membership_excludes_silent_and_readmits_rejoined():
    control = Control.serve("127.0.0.1")
    world = StandInWorld()
    config = SyncConfig(timeout_s=0.3)
    coord = Coordinator(control, world.spans, world.groups, 2, config)
    from shardplan.sync.control import join

    for name in coord.names():
        join(control, name, None)
    ann = coord.announce(1)
    assert set(ann.members) == set(coord.names())
    for name, epoch in ann.members.items():  # everyone but consumer1 reports; consumer3 failed (bumped epoch)
        if name != "consumer1":
            control.set(f"v1/result/{name}", f'{{"ok": true, "epoch": {epoch + (5 if name == "consumer3" else 0)}}}')
    ann2 = coord.announce(2)
    assert "consumer1" not in ann2.members and ann2.excluded == ("consumer1",)
    assert ann2.members["consumer3"] == ann.members["consumer3"] + 5
    for name, epoch in ann2.members.items():
        control.set(f"v2/result/{name}", f'{{"ok": true, "epoch": {epoch}}}')
    join(control, "consumer1", None)  # restarted
    ann3 = coord.announce(3)
    assert "consumer1" in ann3.members and ann3.schedule_id == ann.schedule_id  # same membership, same schedule


# ---- whole syncs over each transport ---------------------------------------------------------------------------------
def test_sync_nccl_adapter_over_gloo_with_faults():
    cluster = LocalCluster("nccl", StandInWorld)
    try:
        scenario(cluster, stall=True)
    finally:
        cluster.close()


def test_corrupted_bytes_fail_the_version_by_name_and_the_next_sync_repairs():
    """A byte flipped after the transport delivered it: that consumer's sync fails with ChecksumMismatch naming the
    trainer and the byte range, its version is left incomplete (the bytes were applied before the deferred check), the
    others complete; the next version is whole and bitwise right everywhere."""
    cluster = LocalCluster("nccl", StandInWorld)
    try:
        cluster.call("consumer1", arm_corruption, 1)
        results = cluster.sync(1)
        err = results["consumer1"][1]
        assert results["consumer1"][0] == "error" and isinstance(err, SyncFailed), results
        (peer, cause), *_ = err.failures.items()
        assert isinstance(cause, ChecksumMismatch) and peer.startswith("trainer"), err
        assert "layers.1" in str(cause) and "checksum" in str(cause), cause
        assert cluster.call("consumer1", state) == (1, False)
        others = [0, 2, 3]
        assert all(results[consumer_name(c)][0] == "ok" for c in others), results
        assert_bitwise(cluster, others)
        results = cluster.sync(2)
        assert all(r[0] == "ok" for r in results.values()), results
        assert_bitwise(cluster, range(cluster.world.num_consumers))
        assert cluster.call("consumer1", state) == (2, True)
    finally:
        cluster.close()


def test_a_trainer_failing_while_packing_ends_every_consumer_at_once_with_its_reason():
    """Over gloo (the `nccl` adapter on CPU) a posted receive cannot poll the control channel, so a trainer that fails
    between two sends (its source raised while packing) closes its pair to each consumer: every consumer's sync fails
    with the trainer's own abort, naming it and what failed, instead of waiting out timeout_s for bytes that never
    come (PeerTimeout, or still waiting when the driver gives up); the next version completes."""
    timeout_s = 60.0  # far longer than the driver waits below
    world = functools.partial(StandInWorld, num_trainers=1)
    cluster = LocalCluster("nccl", world, SyncConfig(timeout_s=timeout_s, announce_timeout_s=60))
    try:
        cluster.call("trainer0", arm_failure, "layers.1")
        results = cluster.sync(1, wait_s=timeout_s / 3)
        assert results["trainer0"][0] == "error", results
        for c in range(cluster.world.num_consumers):
            tag, err = results[consumer_name(c)]
            assert tag == "error" and isinstance(err, SyncFailed), (c, results)
            cause = err.failures.get("trainer0")
            assert isinstance(cause, PeerAborted), (c, err)
            assert "trainer0 stopped" in str(cause) and "failed while packing layers.1" in str(cause), cause
        cluster.call("trainer0", arm_failure, None)
        results = cluster.sync(2)
        assert all(r[0] == "ok" for r in results.values()), results
        assert_bitwise(cluster, range(cluster.world.num_consumers))
    finally:
        cluster.close()


@pytest.mark.parametrize(
    "world",
    [PlanWorld, functools.partial(PlanWorld, refuse_direct=True), functools.partial(PlanWorld, direct_bytes=None)],
    ids=["sent-from-trainer-tensors", "some-packed-instead", "all-packed"],
)
def test_direct_segments_are_sent_from_the_trainers_tensors_bitwise(world):
    """Segments that are one contiguous range of one source go out of the trainer's tensor itself (no staging copy),
    as messages of their own on both sides; where the packer gives no view of one (a tensor it cannot send from),
    the same message comes out of staging. Either way the consumers' params equal the reference interpreter's,
    bitwise."""
    w = world()
    planned = sum(s.nbytes for spans in w.spans.values() for g in spans.values() for s in g if s.direct)
    assert (planned > 0) == (w.direct_bytes is not None), planned
    cluster = LocalCluster("nccl", world, SyncConfig(timeout_s=20, announce_timeout_s=60))
    try:
        results = cluster.sync(1)
        assert all(r[0] == "ok" for r in results.values()), results
        direct = sum(r[1].direct_nbytes for n, r in results.items() if n.startswith("trainer"))
        assert (0 < direct < planned) if w.refuse_direct else direct == planned, (direct, planned)
        for c in range(w.num_consumers):
            got, want = cluster.call(consumer_name(c), received), w.reference(c)
            for name in want:
                assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), (c, name)
    finally:
        cluster.close()


@pytest.mark.parametrize("in_place", ["all", "alternate"])
@pytest.mark.parametrize("direct_bytes", [1024, None], ids=["direct-sends", "all-packed"])
def test_segments_received_straight_into_params_equal_the_reference_bitwise(direct_bytes, in_place):
    """A consumer whose unpacker gives receive targets (the engine backend's way: Applier.in_place_segments) gets
    those messages straight into its params, checksummed there, and apply skips them; the params (NaN-poisoned)
    equal the reference interpreter's, bitwise, with the rest (every other such message: "alternate") applied from
    the buffer as usual."""
    world = functools.partial(PlanWorld, in_place=in_place, direct_bytes=direct_bytes)
    w = world()
    cluster = LocalCluster("nccl", world, SyncConfig(timeout_s=20, announce_timeout_s=60))
    try:
        results = cluster.sync(1)
        assert all(r[0] == "ok" for r in results.values()), results
        for c in range(w.num_consumers):
            landed = cluster.call(consumer_name(c), in_place_bytes)
            total = sum(s.nbytes for g in w.groups for s in w.spans[c].get(g, ()))
            assert 0 < landed <= total if in_place == "all" else 0 < landed < total, (c, landed, total)
            got, want = cluster.call(consumer_name(c), received), w.reference(c)
            for name in want:
                assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), (c, name)
    finally:
        cluster.close()


def test_sync_mooncake_tcp_with_faults():
    pytest.importorskip("mooncake.engine", exc_type=ImportError)
    cluster = LocalCluster("mooncake:tcp", StandInWorld)
    try:
        scenario(cluster, stall=True)
    finally:
        cluster.close()


@pytest.mark.parametrize(
    "world",
    [PlanWorld, functools.partial(PlanWorld, num_consumers=1), ShardedWorld, FallbackWorld],
    ids=["replicated-trainers", "groups-split-across-trainers", "sharded-trainers", "fallbacks"],
)
def test_sync_real_plans_equal_reference(world):
    """Through the replay/apply adapters, consumer params equal the reference interpreter's, bitwise; fallback
    tensors reach each consumer's fallback loader whole."""
    got = run_sync(world, "nccl")
    w = world()
    for c in range(w.num_consumers):
        want = w.reference(c)
        assert set(got[c]) == set(want), f"consumer{c}: {sorted(set(got[c]) ^ set(want))}"
        for name, t in want.items():
            assert torch.equal(got[c][name].view(torch.uint8), t.view(torch.uint8)), f"consumer{c} {name}"


def test_fallback_plan_needs_sources_and_loader_on_the_consumer():
    from shardplan.runtime.apply import params_from_plan
    from shardplan.sync import ApplyUnpacker

    w = FallbackWorld()
    params = params_from_plan(w.plans[0], fill=float("nan"))
    with pytest.raises(FallbackRequiredError, match="model.layers.1.self_attn.o_proj.weight.*fallback_loader="):
        ApplyUnpacker(w.plans[0], params, max_group_bytes=PART_BYTES)
    # both sides place fallback tensors identically: the consumer's group sizes match the trainers' layouts
    unpacker = ApplyUnpacker(
        w.plans[0], params, max_group_bytes=PART_BYTES, sources=w.sources, fallback_loader=lambda n, t: None
    )
    for group, size in unpacker.sizes().items():
        segs = w.spans[0][group]
        assert max(seg.offset + seg.nbytes for seg in segs) == size, group


@pytest.mark.budget(120, reason="a Ray cluster and its faults, each waited out to its timeout")
@pytest.mark.parametrize("transport", ["rdt:gloo", "rdt:nixl"])
def test_sync_ray_rdt_with_faults(ray_session, transport):
    if transport == "rdt:nixl":
        pytest.importorskip("nixl")
    cluster = RayCluster(transport, StandInWorld)
    try:
        scenario(cluster, stall=False)
    finally:
        cluster.close()


def test_rank_left_out_of_a_version_rejoins():
    """A rank the coordinator left out (no result seen) raises NotAMember naming itself if asked to sync that
    version, re-joins with a new epoch, and takes part in the next version."""
    cluster = LocalCluster("nccl", functools.partial(StandInWorld, num_consumers=2, num_layers=1))
    try:
        assert all(r[0] == "ok" for r in cluster.sync(1).values())
        cluster.control.lease().delete_key("v1/result/consumer1")  # as if consumer1 had gone silent in v1
        results = cluster.sync(2)
        assert "consumer1" not in results and all(r[0] == "ok" for r in results.values()), results
        with pytest.raises(NotAMember, match=r"consumer1 \(epoch \d+\) is not part of version 2"):
            cluster.call("consumer1", ConsumerSync.sync, 2)
        results = cluster.sync(3)
        assert set(results) == set(cluster.names) and all(r[0] == "ok" for r in results.values()), results
        assert_bitwise(cluster, (0, 1))
        assert cluster.call("consumer1", state) == (3, True)
    finally:
        cluster.close()


# ---- recorded plans of a shrunk MoE model, checked against vLLM's real loader ----------------------------------------
QWEN3_MOE_SHRUNK = tiny("qwen3-30b-a3b", vocab_size=256)


@dataclass
class RecordedWorld(PlanWorld):
    """Plans from a recorded plan file (no vLLM in the rank processes): 2 replicated trainers -> 4 consumers."""

    path: str = ""
    seed: int = 0
    num_consumers: int = 4

    def __post_init__(self):
        from shardplan.plan.file.format import PlanFile
        from shardplan.record.verify import random_checkpoint
        from shardplan.sync import ReplayPacker, spans_of

        plan_file = PlanFile.read(self.path)
        self.plans = [plan_file.rank(r) for r in range(self.num_consumers)]
        metas = [plan_file.sources[n] for n in plan_file.sources]
        self.tensors = random_checkpoint([(m.name, m.shape, m.dtype) for m in metas], self.seed)
        read = set().union(*(p.sources_read() for p in self.plans))
        self.sources = {m.name: m for m in metas if m.name in read}
        self.tensors = {n: t for n, t in self.tensors.items() if n in read}
        self._packer = ReplayPacker(self.plans, self.sources, max_group_bytes=PART_BYTES)
        self.groups, self.spans = list(self._packer.groups()), spans_of(self._packer)


_RECORDED: dict[str, tuple] = {}


def recorded_moe(layout_id: str, tmp_path_factory):
    """(session, plans, plan file) of the shrunk Qwen3-MoE at TP4 or TP2 x EP2, recorded once per module."""
    from shardplan.plan.file.format import write_plan
    from shardplan.plan.layout import Layout
    from shardplan.record.session import RecordSession

    if layout_id not in _RECORDED:
        layout = {"tp4": dict(tp=4), "tp2xep2": dict(tp=2, dp=2, ep=True)}[layout_id]
        session = RecordSession("qwen3-30b-a3b", Layout(**layout), overrides=QWEN3_MOE_SHRUNK)
        plans = [session.record_rank(r)[0] for r in range(4)]
        path = tmp_path_factory.mktemp("plans") / f"qwen3-moe-{layout_id}.plan"
        write_plan(path, session.encode(compile_plans(plans, session.sources)))
        _RECORDED[layout_id] = (session, plans, path)
    return _RECORDED[layout_id]


@pytest.mark.parametrize("transport", ["nccl", "mooncake:tcp", "rdt:gloo", "rdt:nixl"])
@pytest.mark.parametrize("layout_id", ["tp4", "tp2xep2"])
def test_sync_recorded_moe_equals_real_loader(tmp_path_factory, request, layout_id, transport):
    """record (vLLM, meta) -> plan file -> 2 trainers pack -> transport -> 4 consumers apply == vLLM's real
    load_weights on each consumer rank, bitwise, for a shrunk Qwen3-MoE at TP4 and TP2 x EP2, over every transport
    that runs on a CPU box (the nccl adapter over gloo, Mooncake over TCP, Ray RDT over gloo and NIXL), with layers
    moved in parts (RecordedWorld's PART_BYTES)."""
    from shardplan.record.build import build_model, loading_context
    from shardplan.record.verify import bits, random_checkpoint

    if transport.startswith("rdt:"):
        request.getfixturevalue("ray_session")
    if transport == "rdt:nixl":
        pytest.importorskip("nixl")
    if transport.startswith("mooncake"):
        pytest.importorskip("mooncake.engine", exc_type=ImportError)
    session, plans, path = recorded_moe(layout_id, tmp_path_factory)
    got = run_sync(functools.partial(RecordedWorld, path=str(path), seed=7), transport)
    names = [m.name for m in sorted(session.sources, key=lambda m: m.name)]
    by_name = {t[0]: t for t in session.tensors}
    checkpoint = random_checkpoint([by_name[n] for n in names], 7)
    for rank in range(4):
        real = build_model(session.vllm_config, session.layout, rank, "cpu")
        with torch.no_grad(), loading_context(session.vllm_config, session.layout, rank):
            real.load_weights(iter(list(checkpoint.items())))
        real_params = dict(real.named_parameters())
        for meta in plans[rank].params:
            assert torch.equal(bits(got[rank][meta.name]), bits(real_params[meta.name])), f"rank {rank} {meta.name}"


# ---- never deliver wrong weights silently: fresh source tensors, layout agreement, rank mapping --------------------
class _NewTensorsEachSync(FullSource):
    """A source that gathers: every group() call hands new tensor objects (new storage), holding the values of the
    version it was told to serve (as an FSDP/DTensor trainer's full_tensor() per layer does)."""

    def __init__(self, sources):
        self.sources, self.version = sources, 1
        super().__init__(full_tensors(sources, seed=1))

    def group(self, group):
        return {n: t.clone() for n, t in full_tensors(self.sources, seed=self.version).items() if group_of(n) == group}


@dataclass
class FreshTensorWorld(PlanWorld):
    def source(self, rank):
        return _NewTensorsEachSync(self.sources)

    def reference_at(self, rank, version):
        from shardplan.plan.interp import apply_reference
        from shardplan.runtime.apply import params_from_plan

        params = params_from_plan(self.plans[rank], fill=float("nan"))
        apply_reference(self.plans[rank], full_tensors(self.sources, seed=version), params)
        return params


def _serve_version(engine, version):
    engine.source.version = version


def test_sync_packs_the_tensors_the_source_hands_at_this_sync():
    """The stale-weights bug: a source handing new tensor objects at every sync must get *those* packed, not the ones
    bound at the first sync (each consumer then reported its version complete with version-1 weights)."""
    cluster = LocalCluster("nccl", FreshTensorWorld)
    try:
        w = cluster.world
        for version in (1, 2, 3):
            for t in range(w.num_trainers):
                cluster.call(trainer_name(t), _serve_version, version)
            results = cluster.sync(version)
            assert all(r[0] == "ok" for r in results.values()), results
            for c in range(w.num_consumers):
                got, want = cluster.call(consumer_name(c), received), w.reference_at(c, version)
                assert cluster.call(consumer_name(c), state) == (version, True)
                for name, t in want.items():
                    assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), f"v{version} c{c} {name}"
    finally:
        cluster.close()


def _swap_q_and_k(plan):
    """The same plan with the destinations of q_proj and k_proj swapped: equal sizes, different bytes per param row."""
    from shardplan.plan import ir

    writes = list(plan.writes)
    q = [i for i, w in enumerate(writes) if ".q_proj." in getattr(w.src.leaf, "name", "")]
    k = [i for i, w in enumerate(writes) if ".k_proj." in getattr(w.src.leaf, "name", "")]
    for i, j in zip(q, k):
        writes[i], writes[j] = (
            ir.Write(writes[i].param, writes[j].dst, writes[i].src),
            ir.Write(writes[j].param, writes[i].dst, writes[j].src),
        )
    return ir.RankPlan(plan.rank, plan.params, tuple(writes), plan.fallbacks, plan.not_needed)


@dataclass
class SwappedTrainerWorld(PlanWorld):
    """The trainers pack consumer 1's bytes from a plan whose q/k destinations differ from the consumer's plan."""

    def __post_init__(self):
        super().__post_init__()
        from shardplan.sync import ReplayPacker

        trainer_plans = [self.plans[0], _swap_q_and_k(self.plans[1])]
        self._packer = ReplayPacker(trainer_plans, self.sources, max_group_bytes=PART_BYTES)


def _swap_q_and_k_sources(plan):
    """The same plan with the sources of q_proj and k_proj swapped: the same destinations, other bytes in them."""
    from shardplan.plan import ir

    writes = list(plan.writes)
    q = [i for i, w in enumerate(writes) if ".q_proj." in getattr(w.src.leaf, "name", "")]
    k = [i for i, w in enumerate(writes) if ".k_proj." in getattr(w.src.leaf, "name", "")]
    assert q and len(q) == len(k)
    for i, j in zip(q, k):
        writes[i], writes[j] = (
            ir.Write(writes[i].param, writes[i].dst, writes[j].src),
            ir.Write(writes[j].param, writes[j].dst, writes[i].src),
        )
    return ir.RankPlan(plan.rank, plan.params, tuple(writes), plan.fallbacks, plan.not_needed)


@dataclass
class SwappedSourcesTrainerWorld(PlanWorld):
    """The trainers pack consumer 1's bytes from its plan with the q/k *sources* swapped: every destination (so the
    pack layout) is the consumer's, the bytes are not."""

    def __post_init__(self):
        super().__post_init__()
        from shardplan.sync import ReplayPacker

        self.trainer_plans = [self.plans[0], _swap_q_and_k_sources(self.plans[1])]
        self._packer = ReplayPacker(self.trainer_plans, self.sources, max_group_bytes=PART_BYTES)


@dataclass
class NextRankSlicesTrainerWorld(PlanWorld):
    """The trainers pack consumer 1's bytes from rank 0's writes (its slices), relabelled rank 1: same writes, params
    and destinations, so the same pack layout; the sources are the other rank's."""

    def __post_init__(self):
        super().__post_init__()
        from shardplan.plan import ir
        from shardplan.sync import ReplayPacker

        wrong = ir.RankPlan(1, self.plans[1].params, self.plans[0].writes, self.plans[1].fallbacks)
        self.trainer_plans = [self.plans[0], wrong]
        self._packer = ReplayPacker(self.trainer_plans, self.sources, max_group_bytes=PART_BYTES)


@dataclass
class WrongRankWorld(PlanWorld):
    """Consumer 1 applies rank 0's plan (a wrong rank mapping in the launcher); its byte counts equal rank 1's."""

    def unpacker(self, rank):
        return super().unpacker(0)


@pytest.mark.parametrize(
    "world",
    [SwappedTrainerWorld, WrongRankWorld, SwappedSourcesTrainerWorld, NextRankSlicesTrainerWorld],
    ids=["different-destinations", "wrong-rank", "q-k-sources-swapped", "next-rank-slices"],
)
def test_layout_disagreement_is_refused_on_both_sides_before_any_byte_moves(world):
    if world in (SwappedSourcesTrainerWorld, NextRankSlicesTrainerWorld):
        # source-only differences: the pack layouts (destinations) agree, only what the writes read differs
        from shardplan.runtime.pack import PackLayout

        w = world()
        consumer, trainer = w.plans[1], w.trainer_plans[1]
        assert (
            PackLayout.from_plans(consumer, 256, PART_BYTES).digest
            == PackLayout.from_plans(trainer, 256, PART_BYTES).digest
        )
        assert w.unpacker(1).stamp() != w._packer.stamp(1)
        assert w.unpacker(0).stamp() == w._packer.stamp(0)
    cluster = LocalCluster("nccl", world)
    try:
        results = cluster.sync(1)
        assert results["consumer0"][0] == "ok", results
        tag, error = results["consumer1"]
        assert tag == "error" and isinstance(error, SyncFailed), results
        assert any(isinstance(e, LayoutMismatch) for e in error.failures.values()), error
        assert "rank1:" in str(error)
        # every trainer that serves consumer 1 refused too, naming it; the others completed without it
        serving = 0
        for t in ("trainer0", "trainer1"):
            tag, out = results[t]
            if tag == "error":
                serving += 1
                assert isinstance(out.failures["consumer1"], LayoutMismatch), out
            else:
                assert "consumer1" not in out.peers, out
        assert serving, results
        # nothing was applied: consumer 1 still holds its old weights, complete (NaN-poisoned params untouched)
        assert cluster.call("consumer1", state) == (0, True)
        got = cluster.call("consumer1", received)
        assert all(torch.isnan(t.float()).all() for t in got.values())
    finally:
        cluster.close()
