"""EPLB through the sync engine: 2 replicated trainers -> 2 EP consumers over gloo, in processes. Each version, the
driver publishes each consumer's placement as its engine backend would (`v<V>/placement/<consumer>`); every consumer
slot must then hold the expert of that version's placement, bitwise, after rebalances between versions; a consumer that
publishes nothing fails only its own lanes, named (PlacementNotPublished), and the other consumer completes."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import pytest
import torch
from sync_worlds import (
    TIMEOUT_S,
    FullSource,
    LocalCluster,
    Received,
    cluster_setup,
    received,
    spawn_context,
)

from shardplan.plan.placement import make_placement
from shardplan.sync import ApplyUnpacker, ConsumerSync, SyncConfig, TrainerSync, spans_of
from shardplan.sync.control import done_key
from shardplan.sync.placement import EplbPacker, placement_key, publish_placement, slot_spans
from shardplan.transport import consumer_name
from tests.unit.eplb_helpers import eplb_plan_file, expected_slots, random_placement

MOE = (1, 2)


@dataclass
class EplbWorld:
    num_trainers: int = 2
    num_consumers: int = 2

    def __post_init__(self):
        self.plan_file, real = eplb_plan_file()
        self.slots = self.plan_file.header.eplb
        self.plans = [self.plan_file.rank(r) for r in self.plan_file.ranks]
        g = torch.Generator().manual_seed(5)
        self.tensors = {m.name: torch.randn(m.shape, generator=g).to(torch.bfloat16) for m in real}
        self.shard()
        packer = self.packer(None)
        self.groups, self.spans, self.eplb = list(packer.groups()), spans_of(packer), slot_spans(packer)

    def shard(self):
        pass  # whole tensors

    def packer(self, control, timeout_s: float = 60.0):
        return EplbPacker(self.plans, self.plan_file.sources, self.slots, control, timeout_s=timeout_s)

    def source(self, rank):
        return FullSource(self.tensors)

    def unpacker(self, rank):
        from shardplan.runtime.apply import params_from_plan

        params = params_from_plan(self.plans[rank], fill=float("nan"))
        return Received(ApplyUnpacker(self.plans[rank], params), params)


@dataclass
class ShardedEplbWorld(EplbWorld):
    """The same plan fed by FSDP-style sharded trainers: every tensor split by rows over the trainer ranks (each expert
    alike, so each rank holds the same box of every expert), through the engine's path (engine.sharding.sharded_plan
    -> ShardedPacker inside an EplbPacker; ModuleSource over each rank's local shards; consumers apply every
    trainer's part). `uneven`: 3 trainers over 4 rows of some tensors, so a rank holds an empty box of them."""

    num_trainers: int = 2

    def shard(self):
        from shardplan.engine.sharding import sharded_plan
        from shardplan.runtime.shards import tp_shards

        held = {n: m for n, m in self.plan_file.sources.items() if n in self.tensors}
        self.shards = tp_shards(held, self.num_trainers, lambda n: 0)
        self.sharded = sharded_plan(self.plan_file, self.shards)  # the consumers' side

    def packer(self, control, timeout_s: float = 60.0, rank: int = 0):
        from shardplan.engine.trainer import sharded_packer  # what TrainerRank builds for sharded trainers

        return sharded_packer(self.plan_file, self.shards, rank, control, timeout_s=timeout_s)

    def source(self, rank):
        from shardplan.engine.trainer import ModuleSource
        from shardplan.runtime.shards import local_tensors

        local = local_tensors(self.shards, rank, self.tensors)
        return ModuleSource(local, self.plan_file, shards=self.shards, rank=rank)

    def unpacker(self, rank):
        from shardplan.runtime.apply import params_from_plan
        from shardplan.sync import ShardedUnpacker

        params = params_from_plan(self.plans[rank], fill=float("nan"))
        return Received(ShardedUnpacker(self.sharded, rank, params), params)


@dataclass
class ExpertHeldEplbWorld(EplbWorld):
    """The same plan fed by expert-parallel trainers, as Megatron holds a MoE: trainer t holds experts [2t, 2t + 1] of
    every MoE layer whole and every other tensor whole, through the engine's path for such boxes
    (engine.sharding.whole_expert_holders: whole-tensor trainers holding subsets; ModuleSource over each rank's tensors
    with shards=). Only a slot's expert's holder can send it, so each version is scheduled for the placements the
    consumers published (Coordinator(eplb=))."""

    def shard(self):
        from shardplan.engine.sharding import whole_expert_holders
        from shardplan.plan.names import expert_of
        from shardplan.runtime.shards import ep_shards

        held = {n: m for n, m in self.plan_file.sources.items() if n in self.tensors}
        self.shards = ep_shards(held, self.num_trainers, expert_of, self.slots.num_logical_experts)
        assert whole_expert_holders(self.plan_file, self.shards)

    def source(self, rank):
        from shardplan.engine.trainer import ModuleSource
        from shardplan.runtime.shards import local_tensors

        local = local_tensors(self.shards, rank, self.tensors)
        return ModuleSource(local, self.plan_file, shards=self.shards, rank=rank)


def build_eplb_rank(world_factory, name, transport, control, config=None):
    world = world_factory()
    config = config or SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=60)
    if name.startswith("trainer"):
        rank = int(name[7:])
        packer = world.packer(control, config.timeout_s, **({"rank": rank} if hasattr(world, "sharded") else {}))
        return TrainerSync(rank, packer, world.source(rank), transport, control, config)
    return ConsumerSync(int(name[8:]), world.unpacker(int(name[8:])), transport, control, config)


class EplbCluster(LocalCluster):
    def __init__(self, transport: str, world_factory):
        cluster_setup(self, transport, world_factory, None)
        self.build = functools.partial(build_eplb_rank, world_factory, config=self.config)
        self.ctx = spawn_context()
        self.procs = {}
        for name in self.names:
            self._spawn(name)
        for name in self.names:
            self._ready(name)


def sync_placements(cluster, placements) -> None:
    """Versions 1, 2, ... each with its placement published for every consumer: all ranks ok, both trainers sending,
    every consumer slot bitwise the expert its placement puts there, nothing left NaN."""
    world = cluster.world
    for version, placement in enumerate(placements, start=1):
        for c in range(world.num_consumers):
            publish_placement(cluster.control, version, consumer_name(c), placement)
        results = cluster.sync(version)
        assert all(r[0] == "ok" for r in results.values()), (version, results)
        assert all(results[f"trainer{t}"][1].nbytes > 0 for t in (0, 1)), results
        for c in range(world.num_consumers):
            params = cluster.call(consumer_name(c), received)
            expected_slots(params, placement, world.slots, c, world.tensors)
            for name, t in params.items():
                assert not torch.isnan(t.float()).any(), (version, c, name)


def test_each_version_fills_slots_from_the_placement_its_consumer_published():
    cluster = EplbCluster("nccl", EplbWorld)
    world = cluster.world
    slots = world.slots
    try:
        placements = {
            1: [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]],  # start-up
            2: [[1, 2, 0, 3, 2, 0], [3, 3, 2, 1, 0, 1]],  # rebalanced: a replica twice on rank 0
            3: [[0, 2, 1, 3, 1, 1], [2, 3, 0, 1, 0, 2]],
        }
        for version in (1, 2):
            placement = make_placement(placements[version], slots)
            for c in range(world.num_consumers):
                publish_placement(cluster.control, version, consumer_name(c), placement)
            results = cluster.sync(version)
            assert all(r[0] == "ok" for r in results.values()), results
            for c in range(world.num_consumers):
                params = cluster.call(consumer_name(c), received)
                expected_slots(params, placement, slots, c, world.tensors)
                for name, t in params.items():
                    assert not torch.isnan(t.float()).any(), name

        # v3: consumer1's engine publishes no placement: its lanes fail, named; consumer0 completes
        placement = make_placement(placements[3], slots)
        publish_placement(cluster.control, 3, consumer_name(0), placement)
        assert cluster.control.try_get(placement_key(3, consumer_name(1))) is None
        results = cluster.sync(3, wait_s=60)
        assert results["consumer0"][0] == "ok", results
        expected_slots(cluster.call("consumer0", received), placement, slots, 0, world.tensors)
        failed = [t for t in ("trainer0", "trainer1") if results[t][0] != "ok"]
        assert failed, results  # the trainer(s) serving consumer1
        for t in failed:
            assert results[t][0] == "error" and "consumer1" in str(results[t][1]), results[t]
            assert "published no EPLB placement for version 3" in str(results[t][1]), results[t]
        assert results["consumer1"][0] == "error", results["consumer1"]
    finally:
        cluster.close()


def test_sharded_trainers_fill_each_slot_from_their_shards_of_the_placed_expert():
    """FSDP-style trainers (every expert split by rows alike over 2 ranks, each rank packing only its rows) feed EPLB
    consumers over three placements, rebalances between them: every consumer slot holds, bitwise, the expert its
    published placement puts there, nothing left NaN, and each trainer sent bytes."""
    cluster = EplbCluster("nccl", ShardedEplbWorld)
    world = cluster.world
    try:
        sync_placements(cluster, [random_placement(world.slots, seed) for seed in (0, 3, 7)])
    finally:
        cluster.close()


def test_expert_parallel_trainers_send_each_slot_from_the_holder_of_its_placed_expert():
    """Trainers each holding half the experts whole feed EPLB consumers over four placements (rebalances between them,
    one putting only trainer 0's experts on consumer 0): every version is scheduled for the placements its consumers
    published, so each slot's bytes come from the trainer holding the expert placed there. Every consumer slot holds,
    bitwise, that expert; nothing is left NaN; both trainers send bytes in every version."""
    cluster = EplbCluster("nccl", ExpertHeldEplbWorld)
    world = cluster.world
    held = {t: {n for n in world.source(t).boxes() if ".experts." in n} for t in (0, 1)}
    assert held[0] and held[1] and not held[0] & held[1]
    try:
        placements = [random_placement(world.slots, seed) for seed in (0, 3, 7)]
        placements.append(make_placement([[0, 1, 0, 2, 3, 1]] * len(world.slots.moe_layers), world.slots))
        sync_placements(cluster, placements)
        cluster.coordinator._forgetting.join(10)  # the marks of versions before the last are deleted
        marks = {v: [done_key(v, f"trainer{t}", "consumer0", 0) for t in (0, 1)] for v in (1, 4)}
        assert all(cluster.control.try_get(k) is None for k in marks[1])
        assert any(cluster.control.try_get(k) is not None for k in marks[4])
    finally:
        cluster.close()


def test_ep_sharded_trainers_with_other_tensors_cut_are_refused_with_eplb_by_name():
    """Trainers holding different experts can serve EPLB slots only as whole-tensor holders (above); with some other
    tensor cut into boxes (a TP-split dense layer) they would need a sharded plan per placement: refused before any
    byte moves, naming the rank, the tensor and what to do."""
    from shardplan.engine.errors import EngineUnsupported
    from shardplan.engine.sharding import sharded_plan, whole_expert_holders
    from shardplan.plan.names import expert_of
    from shardplan.runtime.shards import ep_shards, tp_shards

    world = EplbWorld()
    held = {n: m for n, m in world.plan_file.sources.items() if n in world.tensors}
    dense = "model.layers.0.mlp.down_proj.weight"
    shards = [s for s in ep_shards(held, 2, expert_of, world.slots.num_logical_experts) if s.name != dense]
    shards += tp_shards({dense: held[dense]}, 2, lambda n: 0)
    assert not whole_expert_holders(world.plan_file, shards)
    with pytest.raises(
        EngineUnsupported,
        match=r"trainer rank 0 lacks experts \[2, 3\] of .*experts\.<e>\..*or every box must be whole",
    ):
        sharded_plan(world.plan_file, shards)


def test_engine_sync_feeds_eplb_replicas_from_expert_parallel_trainers(tmp_path):
    """Through the driver: EngineSync over two replicas of the EP=2 EPLB layout (stand-in engines whose workers publish
    their placement as the backend does, each replica its own), given the expert-parallel trainers' boxes
    (ep_shards: every box whole, so the whole-tensor route); two TrainerRanks, each sending only what it holds. Three
    versions with a rebalance on each replica between them: every slot of every replica holds, bitwise, the expert
    its own placement puts there, and nothing is left NaN."""
    from standin_engines import StandInEngine, sync_from_sharded_trainers

    from shardplan.engine.trainer import EngineSync
    from shardplan.plan.names import expert_of
    from shardplan.runtime.shards import ep_shards, local_tensors

    plan_file, real = eplb_plan_file(tmp_path / "toy-moe.plan")
    slots = plan_file.header.eplb
    plans = [plan_file.rank(r) for r in plan_file.ranks]
    engines = [StandInEngine(f"engine-{n}", plans, [0, 1]) for n in "ab"]
    placements = {(v, replica): random_placement(slots, 10 * v + replica) for v in (1, 2, 3) for replica in (0, 1)}
    for e in engines:
        e.timeout_s = 10.0
        e.placements = lambda version, consumer: placements[version, consumer // 2]  # world = 2 plan ranks
    g = torch.Generator().manual_seed(3)
    shards = ep_shards({m.name: m for m in real}, 2, expert_of, slots.num_logical_experts)
    sync = EngineSync(engines, plan_file.path, config=SyncConfig(timeout_s=10.0), shards=shards, replicas=2)
    for version in (1, 2, 3):
        tensors = {m.name: torch.randn(m.shape, generator=g).to(torch.bfloat16) for m in real}
        report, out = sync_from_sharded_trainers(sync, version, lambda t: local_tensors(shards, t, tensors), shards)
        assert report.complete, report
        assert report.trainer.nbytes > 0 and out[0].nbytes > 0
        for replica, engine in enumerate(engines):
            assert (engine.version, engine.paused) == (str(version), False)
            for rank in (0, 1):
                expected_slots(engine.params[rank], placements[version, replica], slots, rank, tensors)
                for name, t in engine.params[rank].items():
                    assert not torch.isnan(t.float()).any(), (version, engine.name, rank, name)


def test_a_version_no_live_trainer_can_serve_is_refused_to_the_waiting_engines_and_the_next_repairs(tmp_path):
    """Only trainer 0 of two expert-parallel trainers comes: no schedule can give trainer 1's experts' slots a sender.
    The driver announces the refusal instead of a schedule, so the engines' workers, already waiting for it, end at
    once (no hang, no timeout of theirs) with the reason; the engines stay paused and incomplete, and the next version
    with both trainers completes and repairs them."""
    from standin_engines import StandInEngine, sync_from_sharded_trainers

    from shardplan.engine.errors import SyncIncomplete
    from shardplan.engine.trainer import EngineSync, ModuleSource
    from shardplan.plan.names import expert_of
    from shardplan.runtime.shards import ep_shards, local_tensors

    plan_file, real = eplb_plan_file(tmp_path / "toy-moe.plan")
    slots = plan_file.header.eplb
    engine = StandInEngine("engine", [plan_file.rank(r) for r in plan_file.ranks], [0, 1])
    engine.timeout_s = 30.0  # the workers' own waits: the refusal must end them long before
    engine.placements = lambda version, consumer: random_placement(slots, version)
    g = torch.Generator().manual_seed(4)
    tensors = {m.name: torch.randn(m.shape, generator=g).to(torch.bfloat16) for m in real}
    shards = ep_shards({m.name: m for m in real}, 2, expert_of, slots.num_logical_experts)
    sync = EngineSync([engine], plan_file.path, config=SyncConfig(timeout_s=2.0), shards=shards)
    trainer = sync.trainer_rank(ModuleSource(local_tensors(shards, 0, tensors), sync.plan_file, shards=shards, rank=0))
    start = time.monotonic()
    with pytest.raises(SyncIncomplete, match=r"could not be announced \(ScheduleError: .*no live trainer holds") as e:
        sync.sync(1, trainer=trainer)
    trainer.close()
    assert time.monotonic() - start < 20, e.value  # the first version's wait for joins (2 s), not the workers' 30 s
    assert (engine.version, engine.paused) == ("1:incomplete", True)
    assert all("has no schedule" in s["error"] for s in engine.worker_states()), engine.worker_states()
    report, _ = sync_from_sharded_trainers(sync, 2, lambda t: local_tensors(shards, t, tensors), shards)
    assert report.complete, report
    for rank in (0, 1):
        expected_slots(engine.params[rank], random_placement(slots, 2), slots, rank, tensors)
