"""The sync engine ships block-FP8 plans over every CPU transport like BF16 ones, quantizing on the trainer side.

A shrunk Qwen3-30B-A3B-FP8 is recorded at TP4 (its routed-expert partitions are 96 rows: vLLM refines the expert
scale grid and upsamples each checkpoint scale, which the compiler turns into stride-0 views of the checkpoint scale
whose pieces interleave in memory: this covers them as well as plain fp8 boxes). Two
replicated trainers hold BF16 tensors under the BF16 checkpoint's names (no scales) and pack with
`ReplayPacker(..., quantizer=header.quantizer)`; four consumers apply into NaN-poisoned params. Each consumer's params
== vLLM's real `load_weights` fed the reference quantizer's FP8 checkpoint of the same BF16 tensors, bitwise, over the
nccl adapter (gloo), Mooncake TCP, Ray RDT over gloo and over NIXL, all on loopback. Then the trainer side's named
errors: a tensor the quantizer cannot take, an inf/NaN source, a misaligned box. And the same plan from two sharded
trainers (TP2 row shards of whole blocks, fp32 master weights through the engine's ModuleSource and sharded_plan),
each quantizing its own boxes, over the nccl adapter: bitwise the same real loader; and the user's path for them,
EngineSync(shards=) with one trainer_rank per trainer, against stand-in engines, two versions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import sync_worlds
import torch
from arch_sessions import fp8_overrides
from sync_worlds import FullSource, LocalCluster, PlanWorld, Received

from shardplan.plan.compile.compiler import compile_plans
from shardplan.runtime.quantize import BlockAlignmentError, NonFiniteBlockError, QuantizerDTypeError, quantize_blocks
from shardplan.sync import SyncConfig
from shardplan.transport import consumer_name

QWEN3_FP8_SHRUNK = fp8_overrides("qwen3-30b-a3b")
# each decoder layer moves in 2-3 parts (the parts path); every part re-quantizes the weights it reads
FP8_PART_BYTES = 256 << 10


def trainer_tensors(sources, seed: int) -> dict[str, torch.Tensor]:
    """Random trainer tensors for an FP8 plan's source table: bf16 for every quantized weight (its scale is not a
    trainer tensor), the plan's dtype for the rest."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(sources):
        meta = sources[name]
        if name.endswith("_scale_inv") and sources.get(name.removesuffix("_scale_inv")) is not None:
            continue
        x = torch.randn(meta.shape, generator=gen) * (0.01 + 2 * torch.rand((), generator=gen))
        out[name] = x.to(torch.bfloat16 if meta.dtype == "float8_e4m3fn" else getattr(torch, meta.dtype))
    return out


def fp8_checkpoint(tensors, sources) -> dict[str, torch.Tensor]:
    """The reference quantizer's FP8 checkpoint of the trainer's tensors (what a real FP8 engine would load)."""
    out = {}
    for name, t in tensors.items():
        if sources[name].dtype == "float8_e4m3fn":
            out[name], out[name + "_scale_inv"] = quantize_blocks(t, (128, 128))
        else:
            out[name] = t
    return out


def _one_thread() -> None:
    """In a rank process (packer()/unpacker() run only there): 6 ranks share 2 cores, and torch's default of one
    intra-op thread per core makes each small quantizing op wait for the others' threads."""
    torch.set_num_threads(1)


@dataclass
class Fp8World(PlanWorld):
    """A recorded FP8 plan file: 2 replicated BF16 trainers (quantizing packers) -> 4 consumers."""

    path: str = ""
    seed: int = 0
    num_consumers: int = 4

    def __post_init__(self):
        from shardplan.plan.file.format import PlanFile
        from shardplan.sync import ReplayPacker, spans_of

        plan_file = PlanFile.read(self.path)
        self.plans = [plan_file.rank(r) for r in range(self.num_consumers)]
        self.sources = {n: plan_file.sources[n] for n in plan_file.sources}
        self.tensors = trainer_tensors(self.sources, self.seed)
        self._packer = ReplayPacker(
            self.plans, self.sources, max_group_bytes=FP8_PART_BYTES, quantizer=plan_file.header.quantizer
        )
        self.groups, self.spans = list(self._packer.groups()), spans_of(self._packer)
        assert any("/" in g for g in self.groups), "the parts path is not exercised"

    def packer(self, rank):
        _one_thread()
        return self._packer

    def unpacker(self, rank):
        _one_thread()
        from shardplan.runtime.apply import params_from_plan
        from shardplan.sync import ApplyUnpacker

        params = params_from_plan(self.plans[rank], fill=float("nan"))
        return Received(ApplyUnpacker(self.plans[rank], params, max_group_bytes=FP8_PART_BYTES), params)

    def source(self, rank):
        return FullSource(self.tensors)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def received_bytes(engine) -> dict:
    """A consumer's params as raw bytes (Ray cannot unpickle float8 tensors: torch's legacy storage loader)."""
    return {n: as_bytes(t) for n, t in engine.unpacker.received.items()}


def run_sync(world_factory, transport: str) -> dict:
    """sync_worlds.run_sync with longer deadlines: an FP8 expert group is quantized whole on every pack (~1 ms on a
    quiet core, 100x that on a loaded 2-core box running 6 ranks), and the quantizing packers are built ~3 s per
    consumer plan (a full-suite run with other jobs on the box once ran past 30 s); a real hang is still named."""
    config = SyncConfig(timeout_s=90.0, announce_timeout_s=180)
    return sync_worlds.run_sync(world_factory, transport, config=config, read=received_bytes)


@dataclass
class ShardedFp8World(Fp8World):
    """The same plan file fed by 2 sharded trainers, as a Megatron-style TP2 trainer holds them: every 2-D tensor
    split along dim 0 (a quantized weight at 128-row block boundaries), 1-D tensors on both. Each trainer holds fp32
    master weights as plain local shards (engine.trainer.ModuleSource, shards=) and packs with the engine's path
    (engine.sharding.sharded_plan -> ShardedPacker, quantizing its own boxes); consumers apply every trainer's part.
    `cut`: FSDP2-style even row splits instead, which cut 128-row blocks (the holders exchange block amaxes on the
    control channel before packing)."""

    cut: bool = False

    def __post_init__(self):
        from shardplan.engine.sharding import sharded_plan
        from shardplan.plan.file.format import PlanFile
        from shardplan.runtime.shards import tp_shards
        from shardplan.sync import ShardedPacker, spans_of

        self.plan_file = PlanFile.read(self.path)
        self.plans = [self.plan_file.rank(r) for r in range(self.num_consumers)]
        self.sources = {n: self.plan_file.sources[n] for n in self.plan_file.sources}
        self.tensors = trainer_tensors(self.sources, self.seed)
        held = {n: m for n, m in self.sources.items() if n in self.tensors}  # no scales
        self.shards = tp_shards(
            held,
            self.num_trainers,
            lambda n: 0 if len(held[n].shape) == 2 else None,
            block=lambda n: 1 if self.cut or n + "_scale_inv" not in self.sources else 128,
        )
        self.sharded = sharded_plan(self.plan_file, self.shards)
        first = ShardedPacker(self.sharded, 0)
        self.groups, self.spans = list(first.groups()), spans_of(first)

    def packer(self, rank):
        from shardplan.sync import ShardedPacker

        _one_thread()
        return ShardedPacker(self.sharded, rank)

    def source(self, rank):
        from shardplan.engine.trainer import ModuleSource
        from shardplan.runtime.shards import local_tensors

        master = {n: t.float() for n, t in local_tensors(self.shards, rank, self.tensors).items()}
        return ModuleSource(master, self.plan_file, shards=self.shards, rank=rank)

    def unpacker(self, rank):
        from shardplan.runtime.apply import params_from_plan
        from shardplan.sync import ShardedUnpacker

        _one_thread()
        params = params_from_plan(self.plans[rank], fill=float("nan"))
        return Received(ShardedUnpacker(self.sharded, rank, params), params)


_RECORDED: dict = {}


def recorded(tmp_path_factory):
    """(session, plans, plan file path) of the shrunk Qwen3-30B-A3B-FP8 at TP4, recorded once per module."""
    from shardplan.plan.file.format import write_plan
    from shardplan.plan.layout import Layout
    from shardplan.record.session import RecordSession

    if not _RECORDED:
        session = RecordSession("qwen3-30b-a3b-fp8", Layout(tp=4), overrides=QWEN3_FP8_SHRUNK)
        plans = [session.record_rank(r)[0] for r in range(4)]
        path = tmp_path_factory.mktemp("plans") / "qwen3-fp8-tp4.plan"
        write_plan(path, session.encode(compile_plans(plans, session.sources)))
        _RECORDED.update(session=session, plans=plans, path=path)
    return _RECORDED["session"], _RECORDED["plans"], _RECORDED["path"]


@pytest.mark.budget(180, reason="records the FP8 plan and runs a 4-rank sync per transport (Ray for rdt)")
@pytest.mark.parametrize("transport", ["nccl", "mooncake:tcp", "rdt:gloo", "rdt:nixl"])
def test_fp8_sync_equals_real_loader_on_the_reference_checkpoint(tmp_path_factory, request, transport):
    if transport.startswith("rdt:"):
        request.getfixturevalue("ray_session")
    if transport == "rdt:nixl":
        pytest.importorskip("nixl")
    if transport.startswith("mooncake"):
        pytest.importorskip("mooncake.engine", exc_type=ImportError)
    session, plans, path = recorded(tmp_path_factory)
    world = Fp8World(path=str(path), seed=11)
    assert not any(
        n.endswith("_scale_inv")
        for s in world.spans.values()
        for spans in s.values()
        for span in spans
        for n in span.sources
    ), "trainers hold no scales"
    got = run_sync(functools.partial(Fp8World, path=str(path), seed=11), transport)
    for rank in range(4):
        real_params = real_loader_bytes(session, world, rank)
        fp8 = [m.name for m in plans[rank].params if m.dtype == "float8_e4m3fn"]
        assert any("experts" in n for n in fp8) and any(n.endswith("w13_weight_scale_inv") for n in real_params)
        for meta in plans[rank].params:
            assert torch.equal(got[rank][meta.name], real_params[meta.name]), f"rank {rank} {meta.name}"
        for name in fp8:  # every fp8 byte arrived (no NaN poison left, which both sides would share)
            assert not torch.isnan(got[rank][name].view(torch.float8_e4m3fn).float()).any(), f"rank {rank} {name}"


def test_sharded_trainers_quantize_their_own_boxes_over_a_sync(tmp_path_factory):
    """Sharded BF16 trainers (fp32 master weights, no scales) of a block-FP8 plan, through the sync over the nccl
    adapter (gloo): every consumer's params == vLLM's real loader fed the reference quantizer's checkpoint of the
    whole tensors, bitwise; consumer 2's expert rows [192, 288) come from both trainers (blocks 1 and 2)."""
    session, plans, path = recorded(tmp_path_factory)
    world = ShardedFp8World(path=str(path), seed=11)
    pinned = {span.only for s in world.spans.values() for spans in s.values() for span in spans}
    assert pinned == {(0,), (1,)}, pinned
    assert any(
        sum(1 for sp in spans if sp.only == (1,)) and sum(1 for sp in spans if sp.only == (0,))
        for spans in world.spans[2].values()
    )
    got = run_sync(functools.partial(ShardedFp8World, path=str(path), seed=11), "nccl")
    for rank in range(4):
        real_params = real_loader_bytes(session, world, rank)
        for meta in plans[rank].params:
            assert torch.equal(got[rank][meta.name], real_params[meta.name]), f"rank {rank} {meta.name}"


def test_trainers_whose_boxes_cut_blocks_exchange_amaxes_over_a_sync(tmp_path_factory):
    """Three FSDP2-style trainers (every 2-D tensor split evenly by rows: 768-row experts as 256-row boxes, others
    cut mid-block) of the same plan, fp32 master weights: the holders of each cut block exchange its amax on the
    control channel, then each quantizes its rows with the whole block's scale; every consumer's params == the real
    loader on the reference checkpoint, bitwise."""
    session, plans, path = recorded(tmp_path_factory)
    world = ShardedFp8World(path=str(path), seed=11, num_trainers=3, cut=True)
    cutting = {r: [n for n, c in boxes.items() if c.held != c.padded] for r, boxes in world.sharded.cut.items()}
    assert all(cutting[r] for r in range(3)), cutting
    got = run_sync(functools.partial(ShardedFp8World, path=str(path), seed=11, num_trainers=3, cut=True), "nccl")
    for rank in range(4):
        real_params = real_loader_bytes(session, world, rank)
        for meta in plans[rank].params:
            assert torch.equal(got[rank][meta.name], real_params[meta.name]), f"rank {rank} {meta.name}"


def test_the_amax_exchange_of_later_layers_overlaps_the_sends_of_earlier_ones(tmp_path_factory):
    """The same three trainers with trainer 2's partial amaxes of the last layer 4 s late: trainer 1, which shares cut
    blocks with it, sends the earlier layers meanwhile (the exchange runs beside the lanes, a lane waits only for the
    layer it stages) and the sync completes, every consumer bitwise the real loader."""
    from sync_worlds import arm_amax_delay, record_events, recorded_events

    session, plans, path = recorded(tmp_path_factory)
    world = functools.partial(ShardedFp8World, path=str(path), seed=11, num_trainers=3, cut=True)
    cluster = LocalCluster("nccl", world, SyncConfig(timeout_s=90.0, announce_timeout_s=180))
    try:
        last = cluster.world.groups[-1].split("/")[0]
        layers = sorted({g.split("/")[0] for g in cluster.world.groups if g.startswith("layers.")})
        assert len(layers) >= 2 and last != layers[0], cluster.world.groups
        late = layers[-1]
        cluster.call("trainer2", arm_amax_delay, late, 4.0)
        cluster.call("trainer1", record_events)
        results = cluster.sync(1, wait_s=120)
        assert all(r[0] == "ok" for r in results.values()), results
        events = cluster.call("trainer1", recorded_events)
        got = {c: cluster.call(consumer_name(c), received_bytes) for c in range(4)}
    finally:
        cluster.close()
    first = min(i for i, g in enumerate(cluster.world.groups) if g.startswith(layers[0]))
    sent_first = min(t for t, name in events if name == f"send {first} posted")
    exchanged = next(t for t, name in events if name == "amaxes exchanged")
    assert exchanged - sent_first > 2.0, (sent_first, exchanged, events)
    for rank in range(4):
        real_params = real_loader_bytes(session, ShardedFp8World(path=str(path), seed=11), rank)
        for meta in plans[rank].params:
            assert torch.equal(got[rank][meta.name], real_params[meta.name]), f"rank {rank} {meta.name}"


@pytest.mark.budget(120, reason="waits out a stalled holder's timeout")
def test_a_stalled_holder_of_cut_blocks_is_named_and_its_layers_are_not_packed(tmp_path_factory):
    """The same three trainers with trainer 2 stalled before it publishes its block amaxes: trainer 1, which shares
    cut blocks with it, waits for them, names it after the deadline and packs none of the layers they cut (a cut
    block's scale needs every holder's part); every consumer ends with an error, none hangs (trainer 0 shares blocks
    with trainer 1 only)."""
    from sync_worlds import arm_amax_stall

    _, _, path = recorded(tmp_path_factory)
    config = SyncConfig(timeout_s=6.0, announce_timeout_s=60)
    world = functools.partial(ShardedFp8World, path=str(path), seed=11, num_trainers=3, cut=True)
    cluster = LocalCluster("nccl", world, config)
    try:
        cluster.call("trainer2", arm_amax_stall)
        results = cluster.sync(1, wait_s=45)
    finally:
        cluster.close()
    assert results["trainer2"][0] == "hung"
    status, error = results["trainer1"]
    assert status == "error" and "trainer2" in str(error) and "block amaxes of layers." in str(error), error
    assert all(results[consumer_name(c)][0] == "error" for c in range(4)), results


_REAL: dict = {}


def real_loader_bytes(session, world, rank: int) -> dict[str, torch.Tensor]:
    """vLLM's real load_weights of the reference FP8 checkpoint on `rank` (params NaN-poisoned first), as raw bytes;
    the same for every transport (one seed), so built once per module."""
    from shardplan.record import verify
    from shardplan.record.build import build_model, loading_context

    if rank not in _REAL:
        checkpoint = fp8_checkpoint(world.tensors, world.sources)
        real = build_model(session.vllm_config, session.layout, rank, "cpu")
        verify.poison(real)  # a param the loader skipped stays NaN: never equal to the consumer's bytes by chance
        with torch.no_grad(), loading_context(session.vllm_config, session.layout, rank):
            real.load_weights(iter(list(checkpoint.items())))
        _REAL[rank] = {n: as_bytes(t) for n, t in real.named_parameters()}
    return _REAL[rank]


def test_fp8_packer_names_bad_trainer_input(tmp_path_factory):
    """In the sync's packer: an fp8 (already quantized) trainer tensor, an inf in a block the consumer needs, and a
    plan whose fp8 rows lie outside the scale blocks it reads are named errors; nothing is packed silently."""
    import dataclasses

    from shardplan.plan import ir
    from shardplan.sync import ReplayPacker

    _, _, path = recorded(tmp_path_factory)
    world = Fp8World(path=str(path), seed=3)
    plan_quantizer = "fp8-e4m3-block-amax448-v1/128x128"
    packer = ReplayPacker(world.plans, world.sources, max_group_bytes=None, quantizer=plan_quantizer)
    group = "layers.0"
    spans = packer.spans(1, group)
    out = torch.zeros(packer.replayers[1].for_group(group).layout.nbytes, dtype=torch.uint8)
    every = list(range(len(spans)))
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    bad = dict(world.tensors, **{name: world.tensors[name].to(torch.float8_e4m3fn)})
    with pytest.raises(QuantizerDTypeError, match=f"'{name}' is float8_e4m3fn"):
        packer.pack(1, group, bad, out, every)
    bad = dict(world.tensors, **{name: world.tensors[name].clone()})
    bad[name][3, 200] = float("inf")
    with pytest.raises(NonFiniteBlockError, match=rf"'{name}' holds inf at \[3, 200\] \(block \[0, 1\]"):
        packer.pack(1, group, bad, out, every)
    packer.pack(1, group, world.tensors, out, every)  # the good tensors still pack

    # rank 1's q_proj rows [256, 512) read 64 rows lower, with its own scale rows (blocks 2, 3): not a 128-block plan
    plan = world.plans[1]
    q = "model.layers.0.self_attn.q_proj.weight"
    hidden = world.sources[q].shape[1]

    def shifted(w):
        region = w.src.region
        return dataclasses.replace(
            w, src=ir.View(w.src.leaf, ir.Region(region.offset + 64 * hidden, region.sizes, region.strides))
        )

    writes = tuple(shifted(w) if ir.is_pure_view(w) and w.src.leaf == ir.Source(q) else w for w in plan.writes)
    assert writes != plan.writes
    with pytest.raises(BlockAlignmentError, match=rf"rank 1 reads rows/cols \[\[320, 576\], \[0, 256\]\] of '{q}'"):
        ReplayPacker([dataclasses.replace(plan, writes=writes)], world.sources, quantizer=plan_quantizer)


def test_engine_trainer_side_quantizes_an_fp8_plan_by_itself(tmp_path_factory):
    """engine/trainer.py: ModuleSource over fp32 master weights of an FP8 plan asks for no scales and hands each
    quantized weight in the plan's dtype (bf16); make_packer(quantizer=header.quantizer), as TrainerRank and EngineSync
    call it, packs the same bytes as replaying the reference FP8 checkpoint."""
    from shardplan.engine.trainer import ModuleSource
    from shardplan.plan.file.format import PlanFile
    from shardplan.runtime.replay import Replayer
    from shardplan.sync.placement import make_packer

    _, _, path = recorded(tmp_path_factory)
    plan_file = PlanFile.read(path)
    world = Fp8World(path=str(path), seed=5)
    source = ModuleSource({n: t.float() for n, t in world.tensors.items()}, plan_file)
    metas = source.metadata()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not any(n.endswith("_scale_inv") for n in metas) and metas[q].dtype == "bfloat16"
    tensors = source.group("layers.0")
    assert tensors[q].dtype == torch.bfloat16 and torch.equal(tensors[q], world.tensors[q])
    packer = make_packer(
        [plan_file.rank(1)],
        plan_file.sources,
        plan_file.header.eplb,
        max_group_bytes=None,
        quantizer=plan_file.header.quantizer,
    )
    spans = packer.spans(1, "layers.0")
    out = torch.zeros(packer.replayers[1].for_group("layers.0").layout.nbytes, dtype=torch.uint8)
    packer.pack(1, "layers.0", tensors, out, list(range(len(spans))))
    checkpoint = fp8_checkpoint(world.tensors, world.sources)
    expected = Replayer(plan_file.rank(1), plan_file.sources).pack_group("layers.0", checkpoint)
    assert torch.equal(out, expected)


def test_engine_sync_drives_sharded_trainers_of_an_fp8_plan(tmp_path_factory):
    """The user's path (engine.trainer): `EngineSync(engines, fp8_plan, shards=...)` and one `trainer_rank` per
    sharded trainer over its fp32 master shards, two versions, against stand-in engines (standin_engines.py: each
    joins as its consumers, as the backend does, re-planning from the shards in the init info). Every engine param ==
    the reference interpreter on the reference quantizer's checkpoint of that version's tensors, bitwise."""

    from standin_engines import StandInEngine, sync_from_sharded_trainers

    from shardplan.engine.trainer import EngineSync
    from shardplan.plan.file.format import PlanFile
    from shardplan.plan.interp import apply_reference
    from shardplan.runtime.apply import params_from_plan
    from shardplan.runtime.shards import local_tensors, tp_shards

    _, _, path = recorded(tmp_path_factory)
    plan_file = PlanFile.read(path)
    plans = [plan_file.rank(r) for r in range(4)]
    sources = dict(plan_file.sources)
    engines = [StandInEngine("engine-a", plans, [0, 1]), StandInEngine("engine-b", plans, [2, 3])]
    for e in engines:
        e.timeout_s = 90.0
    held = {n: m for n, m in sources.items() if n in trainer_tensors(sources, 0)}
    shards = tp_shards(
        held,
        2,
        lambda n: 0 if len(held[n].shape) == 2 else None,
        block=lambda n: 128 if n + "_scale_inv" in sources else 1,
    )
    sync = EngineSync(engines, path, config=SyncConfig(timeout_s=90.0, announce_timeout_s=180), shards=shards)
    try:
        for version, seed in ((1, 21), (2, 22)):
            tensors = trainer_tensors(sources, seed)
            report, out = sync_from_sharded_trainers(
                sync, version, lambda t: {n: x.float() for n, x in local_tensors(shards, t, tensors).items()}, shards
            )
            assert report.complete and out[0].nbytes > 0, report
            checkpoint = fp8_checkpoint(tensors, sources)
            for e in engines:
                assert (e.version, e.paused) == (str(version), False)
                for r in e.ranks:
                    want = params_from_plan(plans[r], fill=float("nan"))
                    apply_reference(plans[r], checkpoint, want)
                    for name, t in want.items():
                        assert torch.equal(as_bytes(t), as_bytes(e.params[r][name])), f"v{version} rank {r} {name}"
    finally:
        sync.close()
