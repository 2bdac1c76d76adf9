"""Sharded trainers: replay from trainer-local shards + apply == replay from full tensors, bit for bit.

Consumer plans come from test_replay's generators; trainer layouts are random TP (any dim, uneven splits), EP (whole
tensors spread over ranks), PP (by weight group) and their compositions, with optional DP replicas.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_worlds import NAN, assert_matches_reference, bits_equal, random_tensors, worlds

from shardplan.plan import ir
from shardplan.plan.names import expert_of
from shardplan.runtime.apply import Applier, params_from_plan
from shardplan.runtime.replay import Replayer
from shardplan.runtime.shards import (
    ShardLayoutError,
    ShardOverlapError,
    TrainerShard,
    UnassignableWriteError,
    UncoveredSourceError,
    compose,
    ep_shards,
    full_box,
    layer_stage,
    local_tensors,
    plan_shards,
    pp_shards,
    replicate,
    split_range,
    tp_shards,
)


def replay_sharded(plans, sources, shards, full, alignment=256):
    """Every trainer rank packs one buffer for all its consumers; every consumer applies every trainer's buffer."""
    sharded = plan_shards(plans, sources, shards)
    params = {p.rank: params_from_plan(p, fill=NAN) for p in plans}
    appliers = {}
    for t in sharded.trainer_ranks:
        replayer = Replayer(sharded.for_trainer(t), sharded.sources[t], alignment=alignment)
        assert replayer.layout == sharded.layout(t, alignment)  # the consumer derives the same layout
        buffer = replayer.pack(local_tensors(shards, t, full))
        for c, sub in [(c, p) for (tt, c), p in sharded.plans.items() if tt == t]:
            applier = Applier(sub, replayer.layout, params[c])
            applier.apply(buffer)
            appliers[(t, c)] = applier
    return sharded, params, appliers


@st.composite
def layouts(draw, sources: dict[str, ir.TensorMeta]):
    kind = draw(st.sampled_from(["tp", "ep", "pp", "pp_tp", "ep_tp", "full"]))
    names = sorted(sources)
    dim_of = {n: draw(st.none() | st.integers(0, len(sources[n].shape) - 1)) for n in names}
    tp = draw(st.integers(1, 4))
    tp_layout = tp_shards(sources, tp, lambda n: dim_of[n])
    if kind == "tp":
        shards = tp_layout
    elif kind == "full":
        shards = [TrainerShard(n, 0, full_box(m.shape)) for n, m in sources.items()]
    else:
        num = draw(st.integers(1, 3))
        rank_of = {n: draw(st.integers(0, num - 1)) for n in names}
        whole = pp_shards(sources, num, lambda n: rank_of[n])
        shards = whole if kind in ("ep", "pp") else compose(whole, tp_layout, tp)
    dp = draw(st.integers(1, 2))
    world = 1 + max(s.rank for s in shards)
    return replicate(shards, dp, world) if dp > 1 else shards


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), worlds(max_ranks=3, computed=False, overwrites=False), st.integers(0, 2**31 - 1))
def test_sharded_replay_equals_full_replay(data, world, seed):
    plans, sources = world
    shards = data.draw(layouts(sources))
    full = random_tensors(sources, seed)
    try:
        sharded, params, appliers = replay_sharded(plans, sources, shards, full)
    except UncoveredSourceError as e:
        # legit only for a region that is no box (a flattened view narrowed mid-row) of a tensor nobody holds whole
        assert "non-box" in str(e)
        name = str(e).split("region of ")[1].split("'")[1]
        assert not any(s.name == name and s.box == full_box(sources[name].shape) for s in shards)
        return
    for plan in plans:
        got = params[plan.rank]
        mine = [a for (t, c), a in appliers.items() if c == plan.rank]
        covered = {n: torch.zeros(m.shape, dtype=torch.int32) for n, m in ((p.name, p) for p in plan.params)}
        for a in mine:
            for name in a.coverage():
                covered[name] += a.coverage_mask(name).to(torch.int32)
        # pieces from different trainer ranks never overlap (only overlapping writes may, and they stay together)
        assert all((c <= 1).all() for c in covered.values())
        applier = Applier(plan, Replayer(plan, sources).layout, params_from_plan(plan, fill=NAN))
        for name in covered:
            assert torch.equal(covered[name] > 0, applier.coverage_mask(name)), f"{name}: coverage differs"
        assert_matches_reference(plan, applier, got, full)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), worlds(max_ranks=2, computed=True, overwrites=True), st.integers(0, 2**31 - 1))
def test_computed_and_overlapping_writes_with_a_whole_replica(data, world, seed):
    """With one rank holding everything whole (e.g. a DP replica that gathered), Call/Full/Update writes and
    overlapping writes are assignable, and order (last write wins) is kept."""
    plans, sources = world
    tp = data.draw(st.integers(1, 3))
    shards = tp_shards(sources, tp, lambda n: 0) + [TrainerShard(n, tp, full_box(m.shape)) for n, m in sources.items()]
    full = random_tensors(sources, seed)
    _, params, appliers = replay_sharded(plans, sources, shards, full)
    for plan in plans:
        applier = Applier(plan, Replayer(plan, sources).layout, params_from_plan(plan, fill=NAN))
        assert_matches_reference(plan, applier, params[plan.rank], full)


def _tp_plan(rows=8, cols=6, consumer_rows=(2, 7)):
    """One consumer write: param <- w[2:7, :] (crosses trainer TP boundaries)."""
    name = "model.layers.0.w.weight"
    sources = {name: ir.TensorMeta(name, (rows, cols), "bfloat16")}
    n = consumer_rows[1] - consumer_rows[0]
    params = (ir.TensorMeta("model.layers.0.p.weight", (n, cols), "bfloat16"),)
    src = ir.Region(consumer_rows[0] * cols, (n, cols), (cols, 1))
    plan = ir.RankPlan(0, params, (ir.Write(params[0].name, ir.full_region((n, cols)), ir.View(ir.Source(name), src)),))
    return plan, sources, name


def test_pieces_are_split_at_trainer_boundaries_and_local():
    plan, sources, name = _tp_plan()
    shards = tp_shards(sources, 4, lambda n: 0)  # rows [0,2) [2,4) [4,6) [6,8)
    sharded = plan_shards(plan, sources, shards)
    assert sorted(sharded.plans) == [(1, 0), (2, 0), (3, 0)]
    for t, sub in sharded.for_consumer(0).items():
        (w,) = sub.writes
        assert sharded.sources[t][name].shape == (2, 6)
        assert w.src.region.offset == 0  # local: rows start at the shard's first row
    assert sharded.for_consumer(0)[3].writes[0].src.region.sizes == (1, 6)
    full = random_tensors(sources, 3)
    _, params, _ = replay_sharded([plan], sources, shards, full)
    assert bits_equal(params[0]["model.layers.0.p.weight"], full[name][2:7])


def test_uncovered_byte_names_tensor_and_box():
    plan, sources, name = _tp_plan()
    shards = [s for s in tp_shards(sources, 4, lambda n: 0) if s.rank != 2]  # rows [4, 6) held by nobody
    with pytest.raises(UncoveredSourceError) as info:
        plan_shards(plan, sources, shards)
    assert name in str(info.value) and "(4, 6)" in str(info.value)
    with pytest.raises(UncoveredSourceError, match=name):
        plan_shards(plan, sources, [])


def test_non_box_region_needs_a_whole_holder():
    """7 contiguous elements of a [2, 6] tensor: not a box, so row shards can't serve it; a whole copy can."""
    name = "model.layers.0.w.weight"
    sources = {name: ir.TensorMeta(name, (2, 6), "bfloat16")}
    params = (ir.TensorMeta("model.layers.0.p.weight", (7,), "bfloat16"),)
    plan = ir.RankPlan(
        0, params, (ir.Write(params[0].name, ir.full_region((7,)), ir.View(ir.Source(name), ir.Region(0, (7,), (1,)))),)
    )
    with pytest.raises(UncoveredSourceError, match="non-box"):
        plan_shards(plan, sources, tp_shards(sources, 2, lambda n: 0))
    shards = tp_shards(sources, 2, lambda n: 0) + [TrainerShard(name, 2, full_box((2, 6)))]
    full = random_tensors(sources, 0)
    sharded, params_t, _ = replay_sharded([plan], sources, shards, full)
    assert list(sharded.plans) == [(2, 0)]
    assert bits_equal(params_t[0][params[0].name], full[name].reshape(-1)[:7])


def test_column_shards_and_transposed_reads():
    """Consumer reads a transposed column block; trainer shards split columns unevenly."""
    name = "model.layers.3.w.weight"
    sources = {name: ir.TensorMeta(name, (5, 7), "float32")}
    params = (ir.TensorMeta("model.layers.3.p.weight", (4, 3), "bfloat16"),)
    src = ir.Region(2, (4, 3), (1, 7))  # w[0:3, 2:6].t()
    plan = ir.RankPlan(0, params, (ir.Write(params[0].name, ir.full_region((4, 3)), ir.View(ir.Source(name), src)),))
    shards = tp_shards(sources, 3, lambda n: 1)  # columns [0,3) [3,5) [5,7)
    full = random_tensors(sources, 1)
    sharded, params_t, _ = replay_sharded([plan], sources, shards, full)
    assert len(sharded.plans) == 3
    assert bits_equal(params_t[0][params[0].name], full[name][0:3, 2:6].t().to(torch.bfloat16))


def test_merged_rows_view_is_split_back_into_a_box():
    """A view(-1) of whole rows (a merged dim) still plans as a box across row shards."""
    name = "model.layers.0.w.weight"
    sources = {name: ir.TensorMeta(name, (4, 6), "bfloat16")}
    params = (ir.TensorMeta("model.layers.0.p.weight", (18,), "bfloat16"),)
    plan = ir.RankPlan(
        0,
        params,
        (ir.Write(params[0].name, ir.full_region((18,)), ir.View(ir.Source(name), ir.Region(6, (18,), (1,)))),),
    )
    shards = tp_shards(sources, 2, lambda n: 0)
    full = random_tensors(sources, 2)
    sharded, params_t, _ = replay_sharded([plan], sources, shards, full)
    assert sorted(sharded.plans) == [(0, 0), (1, 0)]
    assert bits_equal(params_t[0][params[0].name], full[name][1:4].reshape(-1))


def test_load_balance_across_replicas():
    """Replicated shards (DP) share the bytes: within each replica set, loads differ by at most one piece."""
    names = [f"model.layers.{i}.w.weight" for i in range(12)]
    sources = {n: ir.TensorMeta(n, (8, 4), "bfloat16") for n in names}
    params = tuple(ir.TensorMeta(n.replace(".w.", ".p."), (8, 4), "bfloat16") for n in names)
    plans = [
        ir.RankPlan(
            c,
            params,
            tuple(
                ir.Write(p.name, ir.full_region((8, 4)), ir.View(ir.Source(n), ir.full_region((8, 4))))
                for p, n in zip(params, names)
            ),
        )
        for c in range(3)
    ]
    shards = replicate(tp_shards(sources, 2, lambda n: 0), 3, 2)  # TP2 x DP3: ranks 0,2,4 hold the top rows
    sharded = plan_shards(plans, sources, shards)
    piece = 4 * 4 * 2
    for replicas in ([0, 2, 4], [1, 3, 5]):
        loads = [sharded.bytes_by_trainer[r] for r in replicas]
        assert max(loads) - min(loads) <= piece and sum(loads) == 3 * 12 * piece
    # identical pieces for several consumers on one trainer rank are packed once
    for t in sharded.trainer_ranks:
        layout = sharded.layout(t)
        assert sum(len(s.refs) for s in layout.segments) == sum(len(p.writes) for p in sharded.for_trainer(t))
        assert len(layout.segments) == len({w.src for p in sharded.for_trainer(t) for w in p.writes})


def test_non_view_write_needs_whole_inputs_on_one_rank():
    name = "model.layers.0.w.weight"
    sources = {name: ir.TensorMeta(name, (4, 6), "float32")}
    params = (ir.TensorMeta("model.layers.0.p.weight", (24,), "float32"),)
    call = ir.Call("Tensor.reshape", (ir.Arg(0), (-1,)), (), (ir.View(ir.Source(name), ir.Region(0, (6, 4), (1, 6))),))
    write = ir.Write(params[0].name, ir.full_region((24,)), ir.View(call, ir.full_region((24,))))
    plan = ir.RankPlan(0, params, (write,))
    with pytest.raises(UnassignableWriteError, match=name):
        plan_shards(plan, sources, tp_shards(sources, 2, lambda n: 0))
    shards = tp_shards(sources, 2, lambda n: 0) + [TrainerShard(name, 5, full_box((4, 6)))]
    sharded = plan_shards(plan, sources, shards)
    assert list(sharded.plans) == [(5, 0)]


def test_overlapping_writes_split_across_ranks_are_refused():
    plan, sources, name = _tp_plan()
    over = ir.Write(
        plan.writes[0].param,
        ir.Region(0, (1, 6), (6, 1)),
        ir.View(ir.Full(1.0, (1, 6), "bfloat16"), ir.full_region((1, 6))),
    )
    plan = ir.RankPlan(0, plan.params, plan.writes + (over,))
    with pytest.raises(ShardOverlapError, match="overlap"):
        plan_shards(plan, sources, tp_shards(sources, 4, lambda n: 0))


def test_layout_errors_and_helpers():
    plan, sources, name = _tp_plan()
    with pytest.raises(ShardLayoutError, match=name):
        plan_shards(plan, sources, [TrainerShard(name, 0, ((0, 9), (0, 6)))])
    with pytest.raises(ShardLayoutError, match="two boxes"):
        plan_shards(plan, sources, [TrainerShard(name, 0, ((0, 4), (0, 6))), TrainerShard(name, 0, ((4, 8), (0, 6)))])
    assert [split_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert expert_of("model.layers.3.mlp.experts.17.up_proj.weight") == 17
    assert expert_of("model.layers.3.mlp.gate.weight") is None
    stage = layer_stage(61, 4)
    assert [
        stage("model.embed_tokens.weight"),
        stage("model.layers.0.x"),
        stage("model.layers.60.x"),
        stage("lm_head.weight"),
    ] == [0, 0, 3, 3]
    experts = {
        f"model.layers.1.mlp.experts.{e}.w": ir.TensorMeta(f"model.layers.1.mlp.experts.{e}.w", (2,), "bfloat16")
        for e in range(8)
    } | {"model.norm.weight": ir.TensorMeta("model.norm.weight", (2,), "bfloat16")}
    shards = ep_shards(experts, 4, expert_of, 8)
    assert sorted(s.rank for s in shards if s.name.endswith("experts.5.w")) == [2]
    assert sorted(s.rank for s in shards if s.name == "model.norm.weight") == [0, 1, 2, 3]
    composed = compose(ep_shards(experts, 2, expert_of, 8), tp_shards(experts, 2, lambda n: 0), 2)
    assert sorted((s.rank, s.box) for s in composed if s.name.endswith("experts.7.w")) == [
        (2, ((0, 1),)),
        (3, ((1, 2),)),
    ]


def test_tp_shards_in_whole_blocks():
    """block=: split in units of whole blocks (the last one short, a rank may get none); others as tensor_split."""
    sources = {"w": ir.TensorMeta("w", (320, 64), "bfloat16"), "b": ir.TensorMeta("b", (10,), "bfloat16")}
    shards = tp_shards(sources, 3, lambda n: 0, block=lambda n: 128 if n == "w" else 1)
    boxes = {(s.name, s.rank): s.box for s in shards}
    assert [boxes[("w", r)][0] for r in range(3)] == [(0, 128), (128, 256), (256, 320)]
    assert [boxes[("b", r)][0] for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    two = tp_shards(sources, 4, lambda n: 0, block=lambda n: 128)
    assert [s.box[0] for s in two if s.name == "w"] == [(0, 128), (128, 256), (256, 320), (320, 320)]


def test_scale_shards_of_whole_block_boxes_and_the_boxes_that_cut_blocks():
    """A quantized weight's holders make the scales of the blocks their boxes touch (block units, the tensor's edge
    block included); where a box cuts blocks along either dim, every holder of that weight gets its box widened to
    whole blocks (`cut_boxes`: the staged tensor's extent) and the ranks sharing its blocks are its amax peers. A
    trainer holding scales is refused by name."""
    from shardplan.runtime.shards import CutBox, CutGroup, cut_boxes, scale_shards

    q = "fp8-e4m3-block-amax448-v1/128x128"
    sources = {
        "w": ir.TensorMeta("w", (320, 200), "float8_e4m3fn"),
        "w_scale_inv": ir.TensorMeta("w_scale_inv", (3, 2), "float32"),
        "n": ir.TensorMeta("n", (320,), "bfloat16"),
    }
    shards = [
        TrainerShard("w", 0, ((0, 256), (0, 200))),
        TrainerShard("w", 1, ((256, 320), (0, 128))),
        TrainerShard("w", 2, ((256, 320), (128, 200))),
        TrainerShard("w", 3, ((320, 320), (0, 200))),  # empty: holds nothing
        TrainerShard("n", 0, ((0, 320),)),
    ]
    assert scale_shards(shards, sources, q) == [
        TrainerShard("w_scale_inv", 0, ((0, 2), (0, 2))),
        TrainerShard("w_scale_inv", 1, ((2, 3), (0, 1))),
        TrainerShard("w_scale_inv", 2, ((2, 3), (1, 2))),
    ]
    assert cut_boxes(shards, sources, q) == {}  # whole blocks everywhere: nothing to exchange
    fsdp = [TrainerShard("w", 0, ((0, 100), (0, 200))), TrainerShard("w", 1, ((100, 320), (0, 200)))]
    cols = [TrainerShard("w", 0, ((0, 320), (0, 130))), TrainerShard("w", 1, ((0, 320), (130, 200)))]
    assert scale_shards(fsdp, sources, q) == [
        TrainerShard("w_scale_inv", 0, ((0, 1), (0, 2))),
        TrainerShard("w_scale_inv", 1, ((0, 3), (0, 2))),
    ]
    assert cut_boxes(fsdp, sources, q) == {
        0: {"w": CutBox(((0, 100), (0, 200)), ((0, 128), (0, 200)), (128, 128))},
        1: {"w": CutBox(((100, 320), (0, 200)), ((0, 320), (0, 200)), (128, 128))},
    }
    assert cut_boxes(cols, sources, q)[1]["w"].padded == ((0, 320), (128, 200))
    sharded = plan_shards([], sources, fsdp, quantizer=q)
    assert CutGroup(0, ["w"], sharded.cut).peers == [1] and CutGroup(1, ["w"], sharded.cut).peers == [0]
    with pytest.raises(ShardLayoutError, match="trainer rank 0 holds 'w_scale_inv'"):
        scale_shards([TrainerShard("w_scale_inv", 0, ((0, 3), (0, 2)))], sources, q)


def test_cut_group_stages_each_holder_to_the_whole_blocks_quantization():
    """Three holders of a 320 x 200 weight split at rows 100 and 250 (both cut 128-blocks) exchange block amaxes;
    each one's staged tensor, quantized by the reference quantizer, gives its rows the whole tensor's fp8 bytes and
    its blocks the whole tensor's scales, bitwise. Holders handing another dtype, or a tensor grown after the
    exchange, are named instead of giving a block a scale of its own."""
    from shardplan.runtime.quantize import NonFiniteBlockError, quantize_blocks
    from shardplan.runtime.shards import AmaxExchangeError, CutGroup, cut_boxes

    q = "fp8-e4m3-block-amax448-v1/128x128"
    sources = {
        "w": ir.TensorMeta("w", (320, 200), "float8_e4m3fn"),
        "w_scale_inv": ir.TensorMeta("w_scale_inv", (3, 2), "float32"),
    }
    rows = [(0, 100), (100, 250), (250, 320)]
    shards = [TrainerShard("w", r, (rows[r], (0, 200))) for r in range(3)]
    cut = cut_boxes(shards, sources, q)
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(320, 200, generator=gen) * torch.rand(320, 1, generator=gen) * 4).to(torch.bfloat16)
    fp8, scale = quantize_blocks(full)
    local = {r: {"w": full[slice(*rows[r])].clone()} for r in range(3)}
    groups = {r: CutGroup(r, ["w"], cut) for r in range(3)}
    assert [groups[r].peers for r in range(3)] == [[1], [0, 2], [1]]
    partials = {r: groups[r].partials(local[r]) for r in range(3)}
    for r in range(3):
        amaxes = groups[r].combine(partials)
        staged = groups[r].stage(local[r], amaxes)["w"]
        (p0, p1), _ = cut[r]["w"].padded
        got_fp8, got_scale = quantize_blocks(staged)
        h0, h1 = rows[r]
        assert torch.equal(got_fp8[h0 - p0 : h1 - p0].view(torch.uint8), fp8[h0:h1].view(torch.uint8)), r
        assert torch.equal(got_scale, scale[p0 // 128 : -(-p1 // 128)]), r
    with pytest.raises(AmaxExchangeError, match=r"trainer rank 1: the exchanged amaxes of 'w'.*same dtype"):
        groups[1].stage({"w": local[1]["w"] * 2}, groups[1].combine(partials))  # grew since the exchange
    fp32 = {**partials, 0: groups[0].partials({"w": full[0:100].float() * 1.001})}  # amaxes bf16 cannot hold
    with pytest.raises(AmaxExchangeError, match="do not stage exactly"):
        groups[1].stage(local[1], groups[1].combine(fp32))
    bad = full[100:250].clone()
    bad[10, 3] = float("inf")
    with pytest.raises(NonFiniteBlockError, match=r"block \[0, 0\] of trainer tensor 'w' .* rank\(s\) \[1\]"):
        groups[0].combine({**partials, 1: groups[1].partials({"w": bad})})
    with pytest.raises(AmaxExchangeError, match="no block amaxes of 'w' from trainer rank 2"):
        groups[1].combine({r: partials[r] for r in (0, 1)})
