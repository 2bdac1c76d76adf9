"""Block-FP8 (DeepSeek-V3 / Kimi-K2 / Qwen3 FP8) recording and quantize-on-replay, against vLLM's real loader.

* `test_reference_quantizer_is_vllms`: `quantize_blocks` is bitwise vLLM's `per_block_cast_to_fp8`.
* `test_fp8_recording_verifies`: a shrunk block-FP8 config records on this AVX2 box (kernel probes patched for the
  build only, then restored), its plan carries fp8 weights and float32 `*_scale_inv` (MoE `w13/w2_weight_scale_inv`
  included), and replay == the real loader bitwise on random fp8/f32 tensors (`verify.verify_rank`, NaN-poisoned).
* `test_quantizing_replay_equals_real_loader` (hypothesis: the three FP8 built-ins shrunk, TP 1/2/4, EP on/off,
  rank, seed): vLLM's real loader fed with the reference quantizer's FP8 checkpoint of random BF16 tensors ==
  `QuantizingReplayer` packing the same BF16 tensors + `Applier` in the consumer's own layout, bitwise, every param
  NaN-poisoned beforehand.
* `test_refined_scale_grid_is_recorded_exactly`: Qwen3-MoE FP8 with 96-row expert partitions at TP4 (vLLM's
  refined scale grid, its loader upsampling each checkpoint scale): recorded without fallback, bitwise as above.
* `test_sharded_trainers_quantize_their_own_boxes` (hypothesis: the three built-ins, TP 2/4, EP on/off, rank, seed,
  trainer layouts: TP splits of whole blocks along either dim, FSDP-style splits that cut blocks along either dim,
  experts/layers spread whole, compositions, DP replicas): every trainer rank's `ShardedPacker` quantizes its own
  BF16 boxes (where boxes cut blocks, after the holders exchanged block amaxes), the consumer applies every trainer's
  part (`ShardedUnpacker`): bitwise the real loader as above. `test_fsdp2_boxes_that_cut_blocks`: FSDP2's Shard(0)
  over 3 ranks (342-row boxes of 128-row blocks) bitwise; packing before the exchange, a non-finite element in a cut
  block and a trainer holding scales are named.
* `test_misaligned_layout_is_named`: a layout whose TP partitions are not whole blocks is `Fp8BlockMisaligned`,
  repeating vLLM's reason; `test_cli_refuses_kimi_k2_fp8_tp32_with_vllms_reason`: the CLI's one-paragraph error.
"""

from __future__ import annotations

import pytest
import torch
from arch_sessions import fp8_overrides
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardplan.plan import ir
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file.format import PlanFile, decode
from shardplan.plan.layout import Layout
from shardplan.record import verify
from shardplan.record.build import Fp8BlockMisaligned, build_model, loading_context
from shardplan.record.session import RecordSession
from shardplan.runtime.apply import Applier
from shardplan.runtime.pack import PackLayout
from shardplan.runtime.quantize import QuantizingReplayer, quantize_blocks
from shardplan.runtime.shards import (
    AmaxExchangeError,
    ShardLayoutError,
    TrainerShard,
    compose,
    full_box,
    local_tensors,
    plan_shards,
    pp_shards,
    replicate,
    tp_shards,
)
from shardplan.sync import ShardedPacker, ShardedUnpacker

BLOCK = (128, 128)
MODELS = ("deepseek-v3-fp8", "kimi-k2-fp8", "qwen3-30b-a3b-fp8")


_SESSIONS: dict = {}
_PLANS: dict = {}


def session(model: str, tp: int, ep: bool) -> RecordSession:
    key = (model, tp, ep)
    if key not in _SESSIONS:
        _SESSIONS[key] = RecordSession(model, Layout(tp=tp, pp=1, dp=1, ep=ep), overrides=fp8_overrides(model))
    return _SESSIONS[key]


def plan_of(s: RecordSession, rank: int):
    key = (id(s), rank)
    if key not in _PLANS:
        _PLANS[key] = s.record_rank(rank)[0]
    return _PLANS[key]


def test_reference_quantizer_is_vllms():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    gen = torch.Generator().manual_seed(0)
    for shape in [(256, 384), (320, 256), (128, 100), (7, 300)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(shape, generator=gen) * torch.rand(1, generator=gen) * 10).to(dtype)
            x[0, :5] = 0.0  # an all-zero corner still gets the 1e-4 floor
            ours, theirs = quantize_blocks(x, BLOCK), per_block_cast_to_fp8(x, list(BLOCK))
            assert torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8))
            assert torch.equal(ours[1].view(torch.int32), theirs[1].contiguous().view(torch.int32))


def test_fp8_recording_verifies():
    import vllm._custom_ops as ops

    amx, w8a16 = torch.cpu._is_amx_tile_supported, ops._supports_cpu_fp8_w8a16
    s = session("kimi-k2-fp8", 2, True)
    dtypes = {n: d for n, _, d in s.tensors}
    assert dtypes["model.layers.1.mlp.experts.3.down_proj.weight"] == "float8_e4m3fn"
    assert dtypes["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"] == "float32"
    assert dtypes["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"] == "float32"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "bfloat16" and dtypes["model.embed_tokens.weight"] == "bfloat16"
    plan = plan_of(s, 1)
    params = {p.name.rsplit("experts.", 1)[-1]: p.dtype for p in plan.params if "layers.1.mlp.experts." in p.name}
    assert params["w13_weight"] == params["w2_weight"] == "float8_e4m3fn", sorted(params)
    assert params["w13_weight_scale_inv"] == params["w2_weight_scale_inv"] == "float32", sorted(params)
    assert "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv" in plan.sources_read()
    assert not plan.fallbacks
    assert s.quantizer == "fp8-e4m3-block-amax448-v1/128x128"
    assert decode(s.encode(compile_plans([plan], s.sources)))[0].quantizer == s.quantizer
    verdict = verify.verify_rank(s.vllm_config, s.layout, 1, plan, verify.random_checkpoint(s.tensors, 3))
    assert verdict.ok, verdict.mismatched
    assert verdict.num_params > 20
    # the kernel probes are patched for builds only
    assert torch.cpu._is_amx_tile_supported is amx and ops._supports_cpu_fp8_w8a16 is w8a16


def bf16_and_fp8_checkpoints(s: RecordSession, seed: int):
    """Random trainer tensors (bf16 under the weight names, no scales) and the FP8 checkpoint the reference quantizer
    makes of them."""
    gen = torch.Generator().manual_seed(seed)
    trainer, fp8_checkpoint = {}, {}
    for name, shape, dtype in s.tensors:
        if name.endswith("_scale_inv"):
            continue
        x = torch.randn(shape, generator=gen) * (0.01 + 2 * torch.rand((), generator=gen))
        if dtype == "float8_e4m3fn":
            trainer[name] = x.to(torch.bfloat16)
            fp8_checkpoint[name], fp8_checkpoint[name + "_scale_inv"] = quantize_blocks(trainer[name], BLOCK)
        else:
            trainer[name] = fp8_checkpoint[name] = x.to(getattr(torch, dtype))
    return trainer, fp8_checkpoint


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=st.sampled_from(MODELS), tp=st.sampled_from([1, 2, 4]), ep=st.booleans(), data=st.data())
def test_quantizing_replay_equals_real_loader(model, tp, ep, data):
    rank = data.draw(st.integers(0, tp - 1), label="rank")
    check_rank(model, tp, ep, rank, data.draw(st.integers(0, 2**16), label="seed"))


def real_loaded(s: RecordSession, rank: int, checkpoint):
    """vLLM's real loader fed `checkpoint`, every param NaN-poisoned first."""
    real = build_model(s.vllm_config, s.layout, rank, "cpu")
    verify.poison(real)
    with torch.no_grad(), loading_context(s.vllm_config, s.layout, rank):
        real.load_weights(iter(list(checkpoint.items())))
    return real


def poisoned(s: RecordSession, rank: int):
    """A fresh NaN-poisoned model of the rank and its params (and buffers) by name, for a replay to apply into."""
    model = build_model(s.vllm_config, s.layout, rank, "cpu")
    verify.poison(model)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    return model, params


def check_rank(model: str, tp: int, ep: bool, rank: int, seed: int):
    """vLLM's real loader fed the reference quantizer's FP8 checkpoint == the quantizing replay of the BF16 tensors,
    every param bitwise (NaN-poisoned first); returns the plan and the replayer."""
    s = session(model, tp, ep)
    plan_file = PlanFile(*decode(s.encode(compile_plans([plan_of(s, rank)], s.sources))))
    plan = plan_file.rank(rank)
    trainer, fp8_checkpoint = bf16_and_fp8_checkpoints(s, seed)
    real = real_loaded(s, rank, fp8_checkpoint)
    replayed, params = poisoned(s, rank)
    replayer = QuantizingReplayer(plan, plan_file.sources, quantizer=plan_file.header.quantizer)
    assert not any(n.endswith("_scale_inv") for n in replayer.sources_read())
    with torch.no_grad():
        consumer_layout = PackLayout.from_plans(plan, 256, None)  # what the consumer computes from its own plan
        assert consumer_layout.digest == replayer.layout.digest
        Applier(plan, consumer_layout, params).apply(replayer.pack(trainer))
    verdict = verify.RankVerdict(rank)
    verify.compare_models(real, replayed, verdict)
    assert verdict.ok, verdict.mismatched
    fp8_params = [m.name for m in plan.params if m.dtype == "float8_e4m3fn"]
    assert len(fp8_params) >= 6
    for name in fp8_params:  # every fp8 byte the plan covers was written (NaN poison gone)
        assert not torch.isnan(params[name].float()).any(), name
    return plan, replayer


@st.composite
def block_layouts(draw, shapes: dict[str, tuple[int, ...]], quantized: set[str]):
    """Trainer layouts: Megatron-style TP along either dim in whole blocks, or FSDP-style even splits that cut
    blocks ("cut"); whole tensors spread over ranks (EP / PP), their compositions, optionally two DP replicas."""
    kind = draw(st.sampled_from(["tp", "cut", "whole", "whole_tp"]))
    names = sorted(shapes)
    dim_of = {n: draw(st.none() | st.integers(0, len(shapes[n]) - 1)) for n in names}
    tp = draw(st.integers(2, 4 if kind == "cut" else 3))
    cut = kind == "cut" or draw(st.booleans())
    metas = {n: ir.TensorMeta(n, shape, "bfloat16") for n, shape in shapes.items()}
    unit = (lambda n: 1) if cut else (lambda n: BLOCK[0] if n in quantized else 1)
    tp_layout = tp_shards(metas, tp, lambda n: dim_of[n], block=unit)
    if kind == "cut":
        kind = "tp"
    if kind == "tp":
        shards = tp_layout
    else:
        num = draw(st.integers(2, 3))
        rank_of = {n: draw(st.integers(0, num - 1)) for n in names}
        whole = pp_shards(metas, num, lambda n: rank_of[n])
        shards = whole if kind == "whole" else compose(whole, tp_layout, tp)
    if draw(st.booleans()):
        shards = replicate(shards, 2, 1 + max(sh.rank for sh in shards))
    return shards


def exchange_amaxes(packers, shards, trainer_tensors) -> None:
    """What the sync does on the control channel before packing: every holder of a block cut between trainers
    publishes its partial amaxes per group, each rank takes its peers'."""
    partials = {}
    for t, packer in packers.items():
        local = local_tensors(shards, t, trainer_tensors)
        for group in packer.amax_groups():
            partials.setdefault(group, {})[t] = packer.partial_amaxes(group, local)
    for t, packer in packers.items():
        for group in packer.amax_groups():
            assert set(packer.amax_peers(group)) <= set(partials[group])
            packer.set_amaxes(group, {r: partials[group][r] for r in [t, *packer.amax_peers(group)]})


def sharded_sync_into(sharded, rank: int, trainer_tensors, shards, params) -> None:
    """What one consumer of a sync gets from sharded trainers: every trainer rank packs its pieces of each group
    into the consumer's group buffer (ShardedPacker), the consumer applies every part (ShardedUnpacker)."""
    unpacker = ShardedUnpacker(sharded, rank, params)
    buffers = {g: torch.full((n,), 0xFF, dtype=torch.uint8) for g, n in unpacker.sizes().items()}
    packers = {t: ShardedPacker(sharded, t) for t in sorted({s.rank for s in shards})}
    exchange_amaxes(packers, shards, trainer_tensors)
    for t in sharded.trainer_ranks:
        packer = packers[t]
        local = local_tensors(shards, t, trainer_tensors)
        assert not any(n.endswith("_scale_inv") for n in local), "trainers hold no scales"
        for group in packer.groups():
            spans = packer.spans(rank, group)
            mine = [i for i, span in enumerate(spans) if span.only == (t,)]
            if mine:
                packer.pack(rank, group, local, buffers[group], mine)
    with torch.no_grad():
        for group, buffer in buffers.items():
            unpacker.apply(group, buffer)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=st.sampled_from(MODELS), tp=st.sampled_from([2, 4]), ep=st.booleans(), data=st.data())
def test_sharded_trainers_quantize_their_own_boxes(model, tp, ep, data):
    """Trainers holding boxes of whole 128-blocks (no scales) quantize them themselves: the consumer's params ==
    vLLM's real loader fed the reference quantizer's checkpoint of the whole tensors, bitwise, NaN-poisoned first."""
    rank = data.draw(st.integers(0, tp - 1), label="rank")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    s = session(model, tp, ep)
    plan_file = PlanFile(*decode(s.encode(compile_plans([plan_of(s, rank)], s.sources))))
    trainer, fp8_checkpoint = bf16_and_fp8_checkpoints(s, seed)
    quantized = {n for n in trainer if n + "_scale_inv" in fp8_checkpoint}
    shards = data.draw(block_layouts({n: tuple(t.shape) for n, t in trainer.items()}, quantized), label="shards")
    sharded = plan_shards([plan_file.rank(rank)], plan_file.sources, shards, quantizer=plan_file.header.quantizer)
    assert sharded.quantizer == plan_file.header.quantizer
    replayed, params = poisoned(s, rank)
    sharded_sync_into(sharded, rank, trainer, shards, params)
    verdict = verify.RankVerdict(rank)
    verify.compare_models(real_loaded(s, rank, fp8_checkpoint), replayed, verdict)
    assert verdict.ok, verdict.mismatched
    fp8_params = [m.name for m in plan_file.rank(rank).params if m.dtype == "float8_e4m3fn"]
    for name in fp8_params:  # every fp8 byte the plan covers was written (NaN poison gone)
        assert not torch.isnan(params[name].float()).any(), name


def test_fsdp2_boxes_that_cut_blocks():
    """FSDP2's Shard(0) over 3 ranks gives q_b_proj (1024 rows) 342-row boxes: no rank holds those 128-row blocks
    whole; the holders exchange block amaxes and each quantizes its rows with the whole block's scale, bitwise the
    real loader. Packing before the exchange, a non-finite element in a cut block (named with the rank holding it)
    and a trainer holding scales are refused by name."""
    from torch.distributed.tensor import Shard

    from shardplan.engine.sharding import placement_shards, sharded_plan
    from shardplan.runtime.quantize import NonFiniteBlockError

    s = session("kimi-k2-fp8", 2, True)
    plan_file = PlanFile(*decode(s.encode(compile_plans([plan_of(s, 0)], s.sources))))
    trainer, fp8_checkpoint = bf16_and_fp8_checkpoints(s, 0)
    fsdp = placement_shards({n: tuple(t.shape) for n, t in trainer.items()}, [0, 1, 2], lambda n: [Shard(0)])
    sharded = sharded_plan(plan_file, fsdp)
    q = "model.layers.0.self_attn.q_b_proj.weight"
    assert [sharded.cut[r][q].held[0] for r in range(3)] == [(0, 342), (342, 684), (684, 1024)]
    assert [sharded.cut[r][q].padded[0] for r in range(3)] == [(0, 384), (256, 768), (640, 1024)]
    replayed, params = poisoned(s, 0)
    sharded_sync_into(sharded, 0, trainer, fsdp, params)
    verdict = verify.RankVerdict(0)
    verify.compare_models(real_loaded(s, 0, fp8_checkpoint), replayed, verdict)
    assert verdict.ok, verdict.mismatched

    packer = ShardedPacker(sharded, 1)
    local = local_tensors(fsdp, 1, trainer)
    group = "layers.0"
    consumer = packer.consumers()[0]
    spans = packer.spans(consumer, group)
    mine = [i for i, span in enumerate(spans) if span.only == (1,)]
    out = torch.zeros(max(sp.offset + sp.nbytes for sp in spans), dtype=torch.uint8)
    with pytest.raises(AmaxExchangeError, match=r"trainer rank 1: .* cut quantization blocks, .* set_amaxes\(\)"):
        packer.pack(consumer, group, local, out, mine)
    bad = {n: t.clone() for n, t in trainer.items()}
    bad[q][300, 5] = float("nan")  # rank 0's row 300: block [2, 0], cut between ranks 0 and 1
    packers = {t: ShardedPacker(sharded, t) for t in range(3)}
    with pytest.raises(NonFiniteBlockError, match=rf"block \[2, 0\] of trainer tensor '{q}' .* rank\(s\) \[0\]"):
        exchange_amaxes(packers, fsdp, bad)
    whole = [TrainerShard(n, 0, full_box(t.shape)) for n, t in trainer.items()]
    scale = TrainerShard(q + "_scale_inv", 0, full_box(plan_file.sources[q + "_scale_inv"].shape))
    with pytest.raises(ShardLayoutError, match=rf"trainer rank 0 holds '{q}_scale_inv': .* no scales"):
        sharded_plan(plan_file, whole + [scale])
    assert sharded_plan(plan_file, whole).quantizer == plan_file.header.quantizer


def test_refined_scale_grid_is_recorded_exactly():
    """Qwen3-30B-A3B-FP8 shape at TP4: 96-row expert partitions of 128-row blocks. vLLM's loader upsamples each
    checkpoint scale onto its 32-row grid (one scale value feeds several param elements, on several ranks); the
    recorder records those ops (no fallback), the compiler rewrites them into pure views of the checkpoint scale
    (stride 0 where a scale repeats), the quantizing replay quantizes each block the rank touches whole (rows that
    other ranks also receive) and packs those views: bitwise the real loader, on a rank whose rows start mid-block."""
    plan, replayer = check_rank("qwen3-30b-a3b-fp8", 4, False, 1, 5)
    assert not plan.fallbacks
    for suffix in ("experts.w13_weight_scale_inv", "experts.w2_weight_scale_inv"):
        scale_writes = [w for w in plan.writes if w.param.endswith(suffix)]
        assert scale_writes and all(ir.is_pure_view(w) for w in scale_writes), suffix
        assert any(0 in w.src.region.strides for w in scale_writes), suffix
    refined = {m.name: m.shape for m in plan.params}["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv"]
    assert refined == (4, 2 * 96 // 32, 256 // 32), refined  # experts, gate + up rows / 32, hidden / 32
    # vLLM upsamples an expert's whole checkpoint scale, then slices the rank's rows [96, 192) out of it; the
    # rewritten views read the checkpoint scale rows of blocks 0 and 1 only, so rank 1 quantizes rows [0, 256)
    assert replayer.boxes["model.layers.0.mlp.experts.2.up_proj.weight"] == ((0, 256), (0, 256))
    assert replayer.boxes["model.layers.0.self_attn.q_proj.weight"] == ((256, 512), (0, 256))  # aligned: own rows


def test_misaligned_layout_is_named():
    """Dense MLP of 256 at TP4: 64-row partitions of 128-blocks; vLLM's reason is repeated."""
    overrides = [o for o in fp8_overrides("deepseek-v3-fp8") if not o.startswith("intermediate_size")]
    s = RecordSession(
        "deepseek-v3-fp8", Layout(tp=4, pp=1, dp=1, ep=True), overrides=overrides + ["intermediate_size=256"]
    )
    with pytest.raises(
        Fp8BlockMisaligned,
        match=r"vLLM refuses block-FP8 deepseek-v3-fp8 on tp4-ep .*is not "
        r"divisible by weight quantization block_k = 128",
    ):
        s.record_rank(0)


def test_cli_refuses_kimi_k2_fp8_tp32_with_vllms_reason(tmp_path, capsys):
    """The real Kimi-K2 FP8 widths at TP32 (2 layers; the meta build fails on rank 0's dense down_proj, 18432 / 32 =
    576 columns): exit 2, one paragraph that names the model, the layout, vLLM's sentence and what to do."""
    from shardplan.cli import main

    assert (
        main(
            [
                "record",
                "--model",
                "kimi-k2-fp8",
                "--tp",
                "32",
                "--override",
                "num_hidden_layers=2",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(
        "shardplan record: error: vLLM refuses block-FP8 kimi-k2-fp8 on tp32 (rank 0): Weight "
        "input_size_per_partition = 576 is not divisible by weight quantization block_k = 128."
    ), err
    assert "choose a smaller TP size" in err
    assert not list(tmp_path.glob("*.plan"))
