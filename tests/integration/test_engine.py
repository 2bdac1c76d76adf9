"""shardplan inside live vLLM CPU engines, driven by a real trainer (docs/engine.md).

Per layout (tiny Qwen3 dense TP=1, TP=2 and PP=2, tiny Qwen3-MoE TP=2), once per module: a random checkpoint, its plan
(recorded here), one engine with the `shardplan` backend (registered by the plugin entry point) and a trainer process
(transformers, AdamW, no vLLM). Three versions: train a step, save the checkpoint, sync; the engine's greedy tokens
must change at every step and equal a fresh engine of the same layout started from the saved checkpoint.
"""

from __future__ import annotations

import pytest
from engine_support import (
    MOE_INTER,
    TIMEOUT_S,
    FsdpTrainers,
    Trainer,
    assert_moe_path,
    fresh_tokens,
    greedy,
    make_model,
    prefetch_fresh,
    record_plan,
    start_llm,
    stop_llm,
)

from shardplan.engine.trainer import EngineSync
from shardplan.sync import SyncConfig

# name: (MoE, TP, PP, the MoE experts' path pinned, the experts' intermediate size); the MoE layouts pin the path
# (engine_gemm.MOE_MODES) so that every CPU runs both. "moe-tp2-amx" (only where a test asks for it): 96 / TP=2 = 48
# per partition, padded to 64 by the amx experts, so the prepack re-run takes its generic (padding) branch.
# "dense-pp2": two pipeline stages, each worker holding groups the other does not.
LAYOUTS = {
    "dense-tp1": (False, 1, 1, None, None),
    "dense-tp2": (False, 2, 1, None, None),
    "dense-pp2": (False, 1, 2, None, None),
    "moe-tp2": (True, 2, 1, "vec", MOE_INTER),
    "moe-tp2-amx": (True, 2, 1, "amx", 96),
}


class World:
    pass


@pytest.fixture(scope="module", params=["dense-tp1", "dense-tp2", "dense-pp2", "moe-tp2"])
def world(request, tmp_path_factory):
    moe, tp, pp, w_moe, moe_inter = LAYOUTS[request.param]
    w = World()
    w.name, w.tp, w.pp, w.workers, w.moe = request.param, tp, pp, tp * pp, w_moe
    w.root = tmp_path_factory.mktemp(request.param)
    w.model = make_model(w.root, moe, moe_inter=moe_inter or MOE_INTER)
    w.plan = record_plan(w.model, tp, w.root / "plans", pp=pp)
    w.llm = start_llm(w.model, tp, moe=w_moe, pp=pp)
    w.driver = EngineSync([w.llm], w.plan, config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120))
    w.trainer = Trainer(w.model, w.plan, w.driver.control, w.root / "ckpt")
    w.version = 0
    yield w
    w.trainer.stop()
    stop_llm(w.llm)


def sync(w, version: int):
    w.trainer.send("sync", version)
    report = w.driver.sync(version)
    trainer_report = w.trainer.result()
    return report, trainer_report


@pytest.mark.budget(
    330,
    reason="three versions, each against a fresh engine; a layout's first test starts its engine",
)
def test_trained_weights_reach_the_engine_and_match_a_fresh_engine(world):
    w = world
    tokens = greedy(w.llm)
    assert w.llm.get_weight_version() == "default"
    steps = []
    for version in (1, 2, 3):
        checkpoint, loss = w.trainer.call("step", version)
        prefetch_fresh(checkpoint, w.tp, moe=w.moe, pp=w.pp)  # the fresh engine starts while the test goes on
        report, sent = sync(w, version)
        assert report.complete and report.engines[0].complete, str(report)
        assert report.engines[0].weight_version == str(version)
        assert report.engines[0].paused is False
        assert [s["version"] for s in report.engines[0].workers or ()] == [version] * w.workers, str(report)
        assert all(s["complete"] for s in report.engines[0].workers)
        assert sent.nbytes > 0
        new = greedy(w.llm)
        assert new != tokens, f"step {version} did not change the engine's tokens"
        steps.append((checkpoint, new))
        tokens = new
        w.version = version
    for version, (checkpoint, got) in enumerate(steps, 1):
        assert fresh_tokens(checkpoint, w.tp, moe=w.moe, pp=w.pp) == got, (
            f"version {version}: engine != fresh engine from {checkpoint}"
        )
    # the trainer side never imported vLLM (nor safetensors: the test's checkpoint writer is imported lazily)
    assert not [m for m in w.trainer.call("modules") if m.startswith("vllm")]


@pytest.mark.budget(150, reason="a killed trainer's sync times out; a restarted one syncs; a fresh engine compares")
@pytest.mark.parametrize("world", ["dense-tp1", "dense-tp2"], indirect=True)
def test_trainer_killed_mid_sync_leaves_the_engine_paused_and_marked_incomplete(world):
    """The trainer dies after its first group reached the engine: the engine's update fails naming trainer0, every
    layer is whole again (each at one version), its weight version says "<v>:incomplete", it stays paused, a plain
    resume is refused; a restarted trainer's next version completes, resumes it, and matches a fresh engine."""
    import threading
    import time

    from shardplan.engine.errors import SyncIncomplete

    w = world
    version = w.version + 1
    checkpoint, _ = w.trainer.call("step", version)
    w.trainer.send("sync_stall", version)
    outcome = []
    driver = threading.Thread(target=lambda: outcome.append(_catch(lambda: w.driver.sync(version))), daemon=True)
    driver.start()
    tag, _ = w.trainer._recv(120)
    assert tag == "packed"  # the first group is on its way
    time.sleep(1.0)
    w.trainer.kill()
    driver.join(4 * TIMEOUT_S)
    assert not driver.is_alive(), "the driver's sync did not end after the trainer died"
    error = outcome[0]
    assert isinstance(error, SyncIncomplete), error
    engine = error.report.engines[0]
    assert not engine.complete and "trainer0" in engine.error
    assert engine.weight_version == f"{version}:incomplete"
    assert engine.paused is True
    assert [(s["version"], s["complete"]) for s in engine.workers] == [(version, False)] * w.workers
    assert all("trainer0" in s["error"] for s in engine.workers)
    assert w.llm.get_weight_version() == f"{version}:incomplete"
    with pytest.raises(SyncIncomplete):
        w.driver.resume()
    # a restarted trainer (from the last checkpoint it saved) repairs the engine with the next version
    w.trainer = Trainer(checkpoint, w.plan, w.driver.control, w.root / "ckpt-restarted")
    version += 1
    checkpoint, _ = w.trainer.call("step", version)
    prefetch_fresh(checkpoint, w.tp)
    report, _ = sync(w, version)
    assert report.complete and report.engines[0].weight_version == str(version) and not report.engines[0].paused
    tokens = greedy(w.llm)
    w.version = version
    assert fresh_tokens(checkpoint, w.tp) == tokens


def _catch(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        return e


@pytest.mark.parametrize("world", ["dense-tp1", "dense-tp2"], indirect=True)
def test_foreign_plans_are_refused_by_name(world, tmp_path):
    """A plan for another model config, layout or vLLM version is refused at init, naming the field; the engine
    keeps serving and keeps its sync (a later sync still works: at TP=2 every worker refuses, and vLLM's executor
    reads no reply after the first failing one, so refusals must not raise in the workers)."""
    from shardplan.engine.errors import EnginePlanMismatch
    from shardplan.plan.file.format import PlanFile, encode, write_plan
    from shardplan.plan.layout import Layout

    w = world
    before = w.llm.get_weight_version()  # 'default' when this test runs alone, before any sync
    good = PlanFile.read(w.plan)
    h = good.header
    cases = {
        "config": dict(config_sha256="0" * 64),
        "layout": dict(layout=Layout(tp=2 * w.tp)),
        "vLLM": dict(vllm_version="0.31.0"),
        "dtype": dict(dtype="float16"),
        "quantization": dict(quantizer="fp8-e4m3-block-amax448-v1/128x128"),
    }  # a block-FP8 engine's plan
    for field, change in cases.items():
        fields = dict(
            model=h.model,
            architecture=h.architecture,
            config_sha256=h.config_sha256,
            layout=h.layout,
            dtype=h.dtype,
            vllm_version=h.vllm_version,
        )
        fields.update(change)
        path = tmp_path / f"bad-{field}.plan"
        write_plan(path, encode(good.body, **fields))
        other = EngineSync([w.llm], path, config=SyncConfig(timeout_s=TIMEOUT_S))
        with pytest.raises(EnginePlanMismatch, match=field):
            other.init()
    assert w.llm.get_weight_version() == before
    report, _ = sync(w, w.version + 1)
    assert report.complete and [s["version"] for s in report.engines[0].workers] == [w.version + 1] * w.workers, report
    w.version += 1


@pytest.mark.parametrize("world", ["dense-tp1", "dense-tp2"], indirect=True)
def test_wrong_control_port_is_named_within_the_init_timeout(world):
    """Every connect of the engine's init is bounded by its timeout_s (it used to retry 60 s per client, ~135 s in
    all with timeout_s=5); the engine keeps the sync it had."""
    import socket
    import time

    from shardplan.engine.errors import EngineControlUnreachable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    other = EngineSync([world.llm], world.plan, config=SyncConfig(timeout_s=2.0))
    other.init_info.control_port = port
    t0 = time.monotonic()
    with pytest.raises(EngineControlUnreachable, match=rf"127.0.0.1:{port} within 2.0 s"):
        other.init()
    assert time.monotonic() - t0 < 20  # 2 s of connect, plus the RPC and the plan check on a loaded 2-core box
    report, _ = sync(world, world.version + 1)  # the engine's own sync still works
    assert report.complete, report
    world.version += 1


@pytest.mark.parametrize("world", ["dense-tp1"], indirect=True)
def test_trainer_missing_a_tensor_is_named(world):
    from safetensors.torch import load_file

    from shardplan.engine.trainer import ModuleSource
    from shardplan.errors import MissingTensorError

    tensors = load_file(str(world.model / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.down_proj.weight"):
        ModuleSource(tensors, world.plan)


@pytest.mark.budget(150, reason="starts the padded amx MoE engine; three syncs")
@pytest.mark.parametrize("world", ["moe-tp2", "moe-tp2-amx"], indirect=True)
def test_moe_update_reruns_the_cpu_prepack_vllm_032_skips(world):
    """Re-sending the same weights must leave a tiny Qwen3-MoE's tokens unchanged (those of the engine as loaded, or
    as an earlier test left it), on both CPU experts' paths: vec, the prepack re-run writing straight into the kernel
    tensors; amx (torch stand-ins where the CPU has none), its intermediate dim padded, the generic branch. With the
    backend's re-run of the experts' CPU prepack switched off (the vLLM 0.32 path), they change (padded: the update
    fails): the bug this pins. The branch each re-run took is asserted, so skipping either branch fails here too."""
    import torch

    from shardplan.engine.errors import SyncIncomplete

    w = world
    padded = w.moe == "amx"
    branch = "generic" if padded else "kernel tensors"
    stand_in = w.moe == "amx" and not torch.cpu._is_amx_tile_supported()
    for layers in assert_moe_path(w.llm, w.moe, w.tp):
        assert [(p["padded"], p["stand_in"]) for p in layers.values()] == [(padded, stand_in)] * len(layers), layers
    tokens = greedy(w.llm)
    # padded: vLLM's own reload fails, and the update after it must complete (the failure left the TP=2 executor's
    # replies in step: EngineUpdateInfo.errors_in_state)
    steps = (True, False, True)
    for version, rerun in zip(range(w.version + 1, w.version + 4), steps):
        w.trainer.send("sync", version)
        if padded and not rerun:  # vLLM copies the unpadded weights into the padded kernel tensors: it fails
            with pytest.raises(
                SyncIncomplete, match=r"size of tensor a \(128\) must match the size of tensor b \(96\)"
            ):
                w.driver.sync(version, update_options={"rerun_moe_prepack": rerun})
            w.trainer._recv(120)  # whatever the trainer's side made of it
            continue
        report = w.driver.sync(version, update_options={"rerun_moe_prepack": rerun})
        w.trainer.result()
        assert report.complete
        taken = {tuple(p["prepacks"]) for layers in w.llm.collective_rpc("moe_paths") for p in layers.values()}
        assert taken == {(branch,) if rerun else ()}, f"version {version}: prepack re-run branches {taken}"
        got = greedy(w.llm)
        assert (got == tokens) is rerun, f"version {version}, prepack re-run {rerun}"
    w.version += len(steps)


@pytest.mark.budget(150, reason="two FSDP2 trainer processes take a step and sync; a fresh engine compares")
@pytest.mark.parametrize("world", ["dense-tp1"], indirect=True)
def test_fsdp_trainers_update_the_engine_from_their_local_dtensor_shards(world):
    """Two FSDP2 trainer processes (a gloo group), each holding half of every tensor (DTensor Shard(0)) and taking a
    data-parallel AdamW step on its own micro-batch, each sending only its local shards: the engine's tokens change
    and equal a fresh engine's from the gathered checkpoint. The driver learns the boxes from the trainers."""
    from shardplan.engine.sharding import shards_from_json

    w = world
    # a generate on a paused LLM waits for its resume: fail by name if an earlier test left the engine paused
    assert not w.llm.llm_engine.is_sleeping(), f"the engine was left paused at {w.llm.get_weight_version()!r}"
    trainers = FsdpTrainers(w.model, w.plan, w.root / "ckpt-fsdp")
    try:
        layouts = trainers.call("shards")
        assert layouts[0] == layouts[1]
        shards = shards_from_json(layouts[0])
        halves = {s.name: s.box[0] for s in shards if s.rank == 1}
        assert halves and all(box[1] - box[0] > 0 for box in halves.values())
        driver = EngineSync(
            [w.llm], w.plan, config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120), shards=shards
        )
        trainers.call("join", driver.control)
        (checkpoint, local), _ = trainers.call("step", 1)
        prefetch_fresh(checkpoint, w.tp)
        name = "model.layers.0.mlp.gate_proj.weight"
        assert local[name] == (256, 256) and halves[name] == (256, 512)  # the rank holds half of the rows
        before = greedy(w.llm)
        version = w.version + 1
        trainers.send("sync", version)
        report = driver.sync(version)
        sent = trainers.results()
        assert report.complete and report.engines[0].weight_version == str(version), str(report)
        assert [(s["version"], s["complete"]) for s in report.engines[0].workers] == [(version, True)] * w.tp
        assert all(s.nbytes > 0 for s in sent)
        tokens = greedy(w.llm)
        assert tokens != before, "the sharded trainers' step did not change the engine's tokens"
        w.version = version
        assert fresh_tokens(checkpoint, w.tp) == tokens
    finally:
        trainers.stop()
        w.driver.initialized = False  # the engine now follows the sharded driver: re-init at the next sync
