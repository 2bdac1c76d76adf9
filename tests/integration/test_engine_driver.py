"""The trainer-side driver (shardplan.engine.trainer.EngineSync) against stand-in engines, no vLLM: each stand-in
joins the sync as its consumers (ConsumerSync + ApplyUnpacker over plain tensors) when initialized, and keeps the
state a vLLM engine exposes (paused, weight version). Checks the failure semantics the driver owns: a failed update
leaves that engine paused and "<v>:incomplete", a plain resume is refused, the next complete sync repairs and resumes;
a failure before any byte puts the engines back as they were."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from standin_engines import TIMEOUT_S, StandInEngine, sync_from_sharded_trainers
from sync_worlds import full_tensors, tiny_llama_plans

from shardplan.engine.errors import (
    EngineCallFailed,
    EngineError,
    EngineNotInitialized,
    EnginePlanMismatch,
    SyncIncomplete,
    raise_named,
)
from shardplan.engine.sharding import placement_shards
from shardplan.engine.trainer import EngineSync, ModuleSource
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file.format import PlanFile, encode, write_plan
from shardplan.plan.interp import apply_reference
from shardplan.plan.layout import Layout
from shardplan.runtime.apply import params_from_plan
from shardplan.runtime.shards import local_tensors
from shardplan.sync import SyncConfig
from shardplan.transport import Control

REPLICA_TIMEOUT_S = 10.0  # 8-16 gloo pairs open at once in this one process: up to ~5.6 s seen (failures wait 1.5x)


@pytest.fixture
def world(tmp_path):
    plans, sources = tiny_llama_plans(num_consumers=4)
    path = tmp_path / "tiny.plan"
    write_plan(
        path,
        encode(
            compile_plans(plans, list(sources.values())),
            model="tiny",
            architecture="LlamaForCausalLM",
            config_sha256="0" * 64,
            layout=Layout(tp=2, dp=2),
            dtype="bfloat16",
            vllm_version="0.32.0",
        ),
    )
    plan_file = PlanFile.read(path)
    plans = [plan_file.rank(r) for r in range(4)]  # what an engine's workers read
    engines = [StandInEngine("engine-a", plans, [0, 1]), StandInEngine("engine-b", plans, [2, 3])]
    sync = EngineSync(engines, path, config=SyncConfig(timeout_s=TIMEOUT_S), max_group_bytes=2048)
    return plans, sources, engines, sync


def check_params(engine, plans, tensors):
    for r in engine.ranks:
        want = params_from_plan(plans[r], fill=float("nan"))
        apply_reference(plans[r], tensors, want)
        for name, t in want.items():
            assert torch.equal(t.view(torch.uint8), engine.params[r][name].view(torch.uint8)), f"rank {r} {name}"


def test_complete_syncs_reach_every_engine_and_resume_them(world):
    plans, sources, engines, sync = world
    for version, seed in ((1, 1), (2, 2)):
        tensors = full_tensors(sources, seed)
        trainer = sync.trainer_rank(ModuleSource(tensors, sync.plan_file))
        report = sync.sync(trainer=trainer)
        trainer.close()
        assert report.complete and report.version == version and report.trainer.nbytes > 0
        for e in engines:
            assert (e.version, e.paused) == (str(version), False)
            assert e.worker_states() == [
                {"rank": r, "replica": 0, "version": version, "complete": True, "error": ""} for r in e.ranks
            ]
            check_params(e, plans, tensors)


def test_sharded_trainers_send_their_local_shards_by_dtensor_placements(world):
    """Two trainer ranks, each holding only its boxes of every tensor as DTensor placements put them (Shard(0) rows,
    Shard(1) columns, Replicate), each sending from its local shards alone: every engine param is bitwise what the
    plan's reference writes from the full tensors, for two versions."""
    from torch.distributed.tensor import Replicate, Shard

    plans, sources, engines, unsharded = world
    columns = {"model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.q_proj.weight"}
    shards = placement_shards(
        sources,
        [0, 1],
        lambda n: [Replicate()] if len(sources[n].shape) == 1 else [Shard(1)] if n in columns else [Shard(0)],
    )
    boxes = {(s.name, s.rank): s.box for s in shards}
    assert boxes["lm_head.weight", 1] == ((48, 96), (0, 64))
    assert boxes["model.layers.0.self_attn.o_proj.weight", 0] == ((0, 64), (0, 32))
    assert boxes["model.layers.0.input_layernorm.weight", 1] == ((0, 64),)
    sync = EngineSync(engines, unsharded.plan_file.path, config=SyncConfig(timeout_s=TIMEOUT_S), shards=shards)
    for version, seed in ((1, 4), (2, 5)):
        tensors = full_tensors(sources, seed)
        report, out = sync_from_sharded_trainers(sync, version, lambda t: local_tensors(shards, t, tensors), shards)
        assert report.complete and report.trainer.nbytes > 0 and out[0].nbytes > 0
        for e in engines:
            assert (e.version, e.paused) == (str(version), False)
            check_params(e, plans, tensors)


def test_a_failed_update_keeps_that_engine_paused_and_incomplete_until_a_complete_sync(world):
    plans, sources, engines, sync = world
    tensors = full_tensors(sources, 1)
    trainer = sync.trainer_rank(ModuleSource(tensors, sync.plan_file))
    sync.sync(trainer=trainer)
    engines[1].consumers[3].unpacker.fail_at = "layers.1/0"
    with pytest.raises(SyncIncomplete) as caught:
        sync.sync(trainer=trainer)
    report = caught.value.report
    a, b = report.engines
    assert a.complete and a.weight_version == "2" and a.paused is False
    assert not b.complete and b.weight_version == "2:incomplete" and b.paused is True
    assert "injected failure" in b.error
    assert {s["rank"]: (s["version"], s["complete"]) for s in b.workers} == {2: (2, True), 3: (2, False)}
    with pytest.raises(SyncIncomplete, match="engine-b"):
        sync.resume()
    assert engines[1].paused
    engines[1].consumers[3].unpacker.fail_at = None
    tensors = full_tensors(sources, 3)
    trainer = sync.trainer_rank(ModuleSource(tensors, sync.plan_file))  # a new trainer process, say
    report = sync.sync(trainer=trainer)
    assert report.complete and all(e.weight_version == "3" and e.paused is False for e in report.engines)
    check_params(engines[1], plans, tensors)
    sync.resume()  # nothing incomplete any more: allowed


def test_an_update_whose_outcome_cannot_be_read_is_not_reported_complete(world):
    # the driver asks the workers to leave failures in their state (errors_in_state): no state, no "complete"
    plans, sources, engines, sync = world
    engines[1].states_unavailable = True
    trainer = sync.trainer_rank(ModuleSource(full_tensors(sources, 1), sync.plan_file))
    with pytest.raises(SyncIncomplete, match="engine-b: no worker states after update_weights"):
        sync.sync(trainer=trainer)
    assert (engines[0].paused, engines[1].paused) == (False, True)


def test_a_refused_init_leaves_the_engines_serving_as_they_were(world):
    plans, sources, engines, sync = world
    engines[1].refuse_init = "plan.plan is for layout tp4, the engine runs tp2"
    trainer = sync.trainer_rank(ModuleSource(full_tensors(sources, 1), sync.plan_file))
    with pytest.raises(EnginePlanMismatch, match="layout tp4"):
        sync.sync(trainer=trainer)
    assert all((e.paused, e.version) == (False, "default") for e in engines)
    assert sync.version == 0


def test_errors_cross_the_rpc_boundary_by_name():
    with pytest.raises(EnginePlanMismatch, match="for layout tp2"):
        raise_named(
            RuntimeError(
                "Worker failed with error 'EnginePlanMismatch: x.plan is for layout tp2, the engine runs tp1'"
            ),
            "llm: init_weight_transfer_engine",
        )
    with pytest.raises(EngineCallFailed, match="llm: update_weights failed: RuntimeError: boom"):
        raise_named(RuntimeError("boom"), "llm: update_weights")


def test_a_dead_ranks_wait_does_not_drop_a_live_ranks_result(monkeypatch):
    """The announcement after a failed version takes the members from their results. A killed trainer (listed first)
    uses up the wait; the live consumer's result, already there, must still count (it was read with the ~0 s left,
    which on a loaded box timed out: the engine then missed the repair version, NotAMember)."""

    from shardplan.sync import Coordinator
    from shardplan.sync.control import result_key
    from shardplan.transport import PeerTimeout

    control = Control.serve("127.0.0.1", 0)
    coordinator = Coordinator(control, {0: {}}, [], 1, SyncConfig(timeout_s=0.2))
    coordinator.members = {"trainer0": 1, "consumer0": 1}
    control.set(result_key(4, "consumer0"), json.dumps({"ok": False, "epoch": 3, "errors": {}}))
    get = control.get

    def loaded_get(key, timeout_s, peer, what=""):  # a store round trip takes longer than a few ms here
        if timeout_s < 0.05:
            raise PeerTimeout(peer, "no answer within 0.0 s")
        return get(key, timeout_s, peer, what)

    monkeypatch.setattr(control, "get", loaded_get)
    assert coordinator.results(4, 0.2) == {"consumer0": {"ok": False, "epoch": 3, "errors": {}}}


@pytest.fixture
def replicas(world):
    """Two replicas of the dp=2 x tp=2 layout: engines a, b (replica 0) and c, d (replica 1), one EngineSync."""
    plans, sources, _, one = world
    engines = [StandInEngine(f"engine-{n}", plans, ranks) for n, ranks in zip("abcd", ([0, 1], [2, 3]) * 2)]
    for e in engines:  # 8 consumers' gloo pairs open at once in this one process: slower than 5 s on a loaded box
        e.timeout_s = REPLICA_TIMEOUT_S
    sync = EngineSync(
        engines, one.plan_file.path, config=SyncConfig(timeout_s=REPLICA_TIMEOUT_S), max_group_bytes=2048, replicas=2
    )
    return plans, sources, engines, sync


def test_one_sync_feeds_every_replica_of_the_layout(replicas):
    """Every engine of both replicas bitwise equal to the reference, for two versions, from one trainer rank, then
    from two whole-tensor trainer ranks that spread the replicas' bytes between them."""
    plans, sources, engines, one = replicas
    for num_trainers in (1, 2):
        sync = EngineSync(
            engines,
            one.plan_file.path,
            config=SyncConfig(timeout_s=REPLICA_TIMEOUT_S),
            max_group_bytes=2048,
            replicas=2,
            num_trainers=num_trainers,
        )
        for version, seed in ((1, 1), (2, 2)):
            tensors = full_tensors(sources, seed + 10 * num_trainers)
            ranks = [sync.trainer_rank(ModuleSource(tensors, sync.plan_file), rank=t) for t in range(num_trainers)]
            out = []
            senders = [threading.Thread(target=lambda r=r: out.append(r.sync(version))) for r in ranks[1:]]
            for t in senders:
                t.start()
            report = sync.sync(trainer=ranks[0])
            for t in senders:
                t.join()
            for r in ranks:
                r.close()
            assert report.complete and [e.name for e in report.engines] == [f"engine-{n}" for n in "abcd"]
            served = sorted({c for r in [report.trainer, *out] for c in r.peers})
            assert served == sorted(f"consumer{c}" for c in range(8))
            sent = [r.nbytes for r in [report.trainer, *out]]
            assert min(sent) > 0.9 * max(sent), sent  # the replicas' bytes spread evenly over the trainer ranks
            for e in engines:
                assert (e.version, e.paused) == (str(version), False)
                assert {s["replica"] for s in e.worker_states()} == {0 if e.name in ("engine-a", "engine-b") else 1}
                check_params(e, plans, tensors)


def test_a_failed_replica_leaves_the_other_replicas_complete(replicas):
    plans, sources, engines, sync = replicas
    for e in engines:  # as two vllm.LLM handles are (both "llm"): the driver names them apart
        e.name = "engine"
    sync = EngineSync(engines, sync.plan_file.path, config=sync.config, max_group_bytes=2048, replicas=2)
    assert [e.name for e in engines] == [f"engine[{i}]" for i in range(4)]
    trainer = sync.trainer_rank(ModuleSource(full_tensors(sources, 1), sync.plan_file))
    assert sync.sync(trainer=trainer).complete
    engines[3].consumers[3].unpacker.fail_at = "layers.1/0"
    with pytest.raises(SyncIncomplete, match=r"engine\[3\]") as caught:
        sync.sync(trainer=trainer)
    report = caught.value.report
    assert [e.complete for e in report.engines] == [True, True, True, False]
    error = report.engines[3].error  # replica 1's plan rank 3 is consumer 7 on the wire
    assert error.startswith("EngineUpdateFailed: engine[3]: update_weights: plan rank 3 of replica 1: SyncFailed")
    assert "consumer7: RuntimeError: injected failure" in error
    assert [e.paused for e in engines] == [False, False, False, True]
    engines[3].consumers[3].unpacker.fail_at = None
    tensors = full_tensors(sources, 2)
    trainer = sync.trainer_rank(ModuleSource(tensors, sync.plan_file))
    assert sync.sync(trainer=trainer).complete
    for e in engines:
        check_params(e, plans, tensors)


def test_sharded_trainers_feed_every_replica_from_their_local_shards(replicas):
    from torch.distributed.tensor import Shard

    plans, sources, engines, one = replicas
    shards = placement_shards(sources, [0, 1], lambda n: [Shard(0)])
    sync = EngineSync(
        engines, one.plan_file.path, config=SyncConfig(timeout_s=REPLICA_TIMEOUT_S), shards=shards, replicas=2
    )
    tensors = full_tensors(sources, 7)
    report, out = sync_from_sharded_trainers(sync, 1, lambda t: local_tensors(shards, t, tensors), shards)
    assert report.complete and out[0].nbytes > 0
    for e in engines:
        check_params(e, plans, tensors)


def test_a_trainer_built_for_fewer_replicas_is_named_and_the_replica_it_serves_completes(replicas):
    from shardplan.engine.trainer import TrainerRank

    plans, sources, engines, sync = replicas
    tensors = full_tensors(sources, 1)
    trainer = TrainerRank(sync.plan_file, ModuleSource(tensors, sync.plan_file), sync.control, max_group_bytes=2048)
    with pytest.raises(SyncIncomplete) as caught:
        sync.sync(trainer=trainer)
    report = caught.value.report
    assert "trainer0 packs or applies no bytes for consumer 4" in report.trainer_error
    assert "replicas=N" in report.trainer_error
    assert [e.complete for e in report.engines] == [True, True, False, False]
    for e in engines[:2]:
        check_params(e, plans, tensors)


def test_engines_that_each_serve_the_whole_layout_are_refused_without_replicas(world):
    plans, sources, _, one = world
    engines = [StandInEngine(n, plans, [0, 1, 2, 3]) for n in ("engine-x", "engine-y")]
    sync = EngineSync(engines, one.plan_file.path, config=SyncConfig(timeout_s=TIMEOUT_S))
    trainer = sync.trainer_rank(ModuleSource(full_tensors(sources, 1), sync.plan_file))
    with pytest.raises(EnginePlanMismatch, match=r"engine-y and engine-x both serve plan rank 0 .* replicas=2\)"):
        sync.sync(trainer=trainer)
    with pytest.raises(EngineError, match="must split into that many equal replicas"):
        EngineSync(engines, one.plan_file.path, replicas=3)


class DataParallelStandIn:
    """One handle over two engine cores (vLLM's data-parallel ranks of a dense model, each an independent engine of
    the whole layout): calls go to both cores, replies come from the first only, as vLLM's DP client gives them."""

    def __init__(self, name, plans, ranks):
        self.name = name
        self.cores = [StandInEngine(f"{name}/dp{k}", plans, ranks) for k in range(2)]
        self.refuse_core = None  # a core whose init refusal waits in its state (errors_in_state): it never joins

    def init_weight_transfer_engine(self, info):
        for k, core in enumerate(self.cores):  # the backend: DP index k is replica `replica + k`
            if k != self.refuse_core:
                core.init_weight_transfer_engine({**info, "replica": info["replica"] + k})

    def update_weights(self, update_info):
        threads = [threading.Thread(target=c.update_weights, args=(update_info,)) for c in self.cores if c.consumers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def worker_states(self):
        return self.cores[0].worker_states()

    def __getattr__(self, name):  # pause, resume, versions: every core, the first core's answer
        def call(*args):
            return [getattr(c, name)(*args) for c in self.cores][0]

        return call


@pytest.fixture
def dp_engine(world):
    plans, sources, _, one = world
    engine = DataParallelStandIn("engine-dp", plans, [0, 1, 2, 3])
    for core in engine.cores:
        core.timeout_s = REPLICA_TIMEOUT_S
    sync = EngineSync(
        [engine], one.plan_file.path, config=SyncConfig(timeout_s=REPLICA_TIMEOUT_S), max_group_bytes=2048, replicas=2
    )
    return plans, sources, engine, sync


def test_one_handle_over_two_data_parallel_cores_updates_both(dp_engine):
    plans, sources, engine, sync = dp_engine
    tensors = full_tensors(sources, 3)
    report = sync.sync(trainer=sync.trainer_rank(ModuleSource(tensors, sync.plan_file)))
    assert report.complete and sorted(report.trainer.peers) == [f"consumer{c}" for c in range(8)]
    for core in engine.cores:
        check_params(core, plans, tensors)


def test_a_failure_on_a_core_the_replies_do_not_cover_is_not_reported_complete(dp_engine):
    """The second core's update fails; the handle's replies (the first core's) say complete. The workers' states on
    the control channel say otherwise: the driver reports that engine incomplete, naming the plan rank and replica."""
    plans, sources, engine, sync = dp_engine
    trainer = sync.trainer_rank(ModuleSource(full_tensors(sources, 1), sync.plan_file))
    assert sync.sync(trainer=trainer).complete
    engine.cores[1].consumers[2].unpacker.fail_at = "layers.0/0"
    with pytest.raises(SyncIncomplete) as caught:
        sync.sync(trainer=trainer)
    error = caught.value.report.engines[0].error
    assert all(s["complete"] for s in engine.worker_states())  # what the replies say
    assert error.startswith("EngineUpdateFailed: engine-dp: update_weights: plan rank 2 of replica 1 (consumer6):")
    assert "injected failure applying layers.0/0" in error
    engine.cores[1].consumers[2].unpacker.fail_at = None
    tensors = full_tensors(sources, 2)
    assert sync.sync(trainer=sync.trainer_rank(ModuleSource(tensors, sync.plan_file))).complete
    for core in engine.cores:
        check_params(core, plans, tensors)


def test_a_core_that_never_joined_is_named_at_init(dp_engine):
    plans, sources, engine, sync = dp_engine
    engine.refuse_core = 1
    trainer = sync.trainer_rank(ModuleSource(full_tensors(sources, 1), sync.plan_file))
    with pytest.raises(EngineNotInitialized, match=r"plan rank 0 of replica 1 \(consumer4\), .* did not join"):
        sync.sync(trainer=trainer)
    assert sync.version == 0 and not engine.cores[0].paused
