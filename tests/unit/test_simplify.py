"""plan/compile/simplify.py: `repeat_interleave` chains over a checkpoint view become pure-view writes (stride 0 where
an element repeats) that write exactly what the chain writes, bitwise (reference interpreter, NaN-poisoned params), on
random boxes: aligned and unaligned, several repeats, dims and nestings; compiled plans template them as pure views."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import canonical, instantiate

from shardplan.plan import ir
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.compile.simplify import MAX_PIECES, compile_writes, simplify_write
from shardplan.plan.interp import apply_reference
from shardplan.plan.template import pure_view_form


def box(shape, starts, lengths) -> ir.Region:
    strides = ir.contiguous_strides(shape)
    return ir.Region(sum(s * st for s, st in zip(starts, strides)), tuple(lengths), strides)


def random_box(rnd, shape) -> tuple[list[int], list[int]]:
    """At least about half of each dim: nested boxes would shrink to single elements (one piece, nothing tested)."""
    starts = [rnd.randint(0, n // 2) for n in shape]
    return starts, [rnd.randint(max(1, (n - s) // 2), n - s) for n, s in zip(shape, starts)]


@st.composite
def chains(draw):
    """(source shape, a view of the source through 1-3 repeat_interleave calls, each input a box of the last value).
    Boxes come from a hypothesis-seeded `random` (uniform: hypothesis' integers favour 0 and full, aligned, boxes)."""
    rnd = draw(st.randoms(use_true_random=False))
    ndim = rnd.randint(1, 3)
    shape = tuple(rnd.randint(1, 7) for _ in range(ndim))
    starts, lengths = random_box(rnd, shape)
    view = ir.View(ir.Source("x"), box(shape, starts, lengths))
    value = tuple(lengths)
    for _ in range(rnd.randint(1, 3)):
        repeats = rnd.randint(1, 4)
        dim = rnd.randint(-ndim, ndim - 1)
        positional = rnd.random() < 0.5
        call = ir.Call(
            "Tensor.repeat_interleave",
            (ir.Arg(0), repeats, dim) if positional else (ir.Arg(0), repeats),
            () if positional else (("dim", dim),),
            (view,),
        )
        value = tuple(n * repeats if d == dim % ndim else n for d, n in enumerate(value))
        starts, lengths = random_box(rnd, value)
        view = ir.View(call, box(value, starts, lengths))
        value = tuple(lengths)
    return shape, view


def reference(plan: ir.RankPlan, sources: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(m.shape, generator=gen) for n, m in sources.items()}
    params = {p.name: torch.full(p.shape, float("nan")) for p in plan.params}
    apply_reference(plan, tensors, params)
    return params


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


@settings(max_examples=300, deadline=None)
@given(chains(), st.integers(0, 3), st.integers(0, 2**16))
def test_pieces_write_what_the_chain_writes(chain, pad, seed):
    shape, src = chain
    sizes = src.region.sizes
    param_shape = tuple(n + pad for n in sizes)  # the destination: a box of a larger param
    dst = box(param_shape, [pad] * len(sizes), sizes)
    w = ir.Write("p", dst, src)
    pieces = simplify_write(w)
    if pieces == [w]:  # kept: only when the pieces would be too many
        assert len(pieces) == 1 and not ir.is_pure_view(w)
        return
    assert all(ir.is_pure_view(p) for p in pieces) and len(pieces) <= MAX_PIECES
    assert sum(p.dst.numel for p in pieces) == dst.numel  # a partition of the destination (equality: no element left)
    sources = {"x": ir.TensorMeta("x", shape, "float32")}
    params = (ir.TensorMeta("p", param_shape, "float32"),)
    want = reference(ir.RankPlan(0, params, (w,)), sources, seed)
    assert bitwise_equal(reference(ir.RankPlan(0, params, tuple(pieces)), sources, seed), want)


def scale_write(rank: int, expert: int) -> ir.Write:
    """One expert's refined scale, as vLLM's loader makes it (Qwen3-30B-A3B-FP8 gate_proj at TP4): the [6, 16]
    checkpoint scale upsampled x2 over rows then columns, rows [3 * rank, 3 * rank + 3) of the [12, 32] result."""
    source = ir.View(ir.Source(f"experts.{expert}.gate_proj.weight_scale_inv"), ir.full_region((6, 16)))
    rows = ir.View(
        ir.Call("Tensor.repeat_interleave", (ir.Arg(0), 2), (("dim", -2),), (source,)), ir.full_region((12, 16))
    )
    cols = ir.Call("Tensor.repeat_interleave", (ir.Arg(0), 2), (("dim", -1),), (rows,))
    return ir.Write(
        "w13_weight_scale_inv",
        ir.Region(expert * 6 * 32, (3, 32), (32, 1)),
        ir.View(cols, box((12, 32), (3 * rank, 0), (3, 32))),
    )


def test_compiled_plan_templates_refined_scales_as_pure_views():
    params = (ir.TensorMeta("w13_weight_scale_inv", (8, 6, 32), "float32"),)
    plans = [ir.RankPlan(rank, params, tuple(scale_write(rank, e) for e in range(8))) for rank in range(4)]
    sources = [ir.TensorMeta(f"experts.{e}.gate_proj.weight_scale_inv", (6, 16), "float32") for e in range(8)]
    body = compile_plans(plans, sources)
    assert body.groups and all(pure_view_form(g.skeleton) is not None for g in body.groups)
    assert not body.ordered
    table = {m.name: m for m in sources}
    for plan in plans:
        got = instantiate(body, plan.rank)
        assert got == canonical(plan)
        assert len(got.writes) == 2 * 8  # a whole 2-row block and a 1-row part of one, per expert
        assert bitwise_equal(reference(got, table, plan.rank), reference(plan, table, plan.rank))


def test_other_calls_are_kept():
    source = ir.View(ir.Source("x"), ir.full_region((4, 6)))
    cases = [
        ir.Call("Tensor.repeat_interleave", (ir.Arg(0), 2), (), (source,)),  # no dim: flattens
        ir.Call(
            "Tensor.repeat_interleave", (ir.Arg(0), ir.Const("int64", (4,), (1, 2, 1, 2))), (("dim", 0),), (source,)
        ),
        ir.Call("Tensor.repeat_interleave", (ir.Arg(0), 2), (("dim", 0), ("output_size", 8)), (source,)),
        ir.Call("Tensor.repeat", (ir.Arg(0), 2, 1), (), (source,)),
        ir.Call("Tensor.repeat_interleave", (ir.Arg(0), True), (("dim", 0),), (source,)),
    ]
    for call in cases:
        w = ir.Write("p", ir.full_region((48,)), ir.View(call, ir.full_region((48,))))
        assert simplify_write(w) == [w]
    # a transposed view of the result is not a box in order: kept
    call = ir.Call("Tensor.repeat_interleave", (ir.Arg(0), 2), (("dim", 0),), (source,))
    w = ir.Write("p", ir.full_region((6, 8)), ir.View(call, ir.Region(0, (6, 8), (1, 6))))
    assert simplify_write(w) == [w]
    # a broadcasting copy (source sizes differ from the destination's): kept
    w = ir.Write("p", ir.full_region((2, 8, 6)), ir.View(call, ir.full_region((8, 6))))
    assert simplify_write(w) == [w]


def test_repeat_interleave_returns_a_fresh_contiguous_tensor():
    """The pass reads a view of a call's value as a box of a contiguous tensor (as the recorder saw its strides):
    torch's repeat_interleave must return one for strided, transposed, expanded and size-1 inputs alike (on the meta
    device, where the recorder runs, and on CPU)."""
    base = torch.randn(4, 6, 5)
    views = [
        base,
        base.transpose(0, 2),
        base[:, ::2],
        base.permute(1, 2, 0),
        base[1:2],
        base[..., :1],
        base.as_strided((3, 4), (0, 1)),
    ]
    for v in views:
        for repeats in (1, 2, 3):
            for dim in range(-v.dim(), v.dim()):
                for t in (v, torch.empty_strided(v.shape, v.stride(), device="meta")):
                    out = t.repeat_interleave(repeats, dim=dim)
                    assert out.is_contiguous() and out.storage_offset() == 0, (v.stride(), repeats, dim, t.device)
                    assert t.device.type == "meta" or out.data_ptr() != t.data_ptr()


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False))
def test_overlap_finder_is_exact_for_boxes(rnd):
    """overlap.overlapping_writes (the pack layout's and the applier's finder) on random boxes of one param, some of
    their dims split in two (as the rewrite's pieces are): True exactly where a write shares an element with another
    (brute force), so interleaved pieces of one destination are not taken for overlapping writes."""
    import numpy as np

    from shardplan.plan.overlap import overlapping_writes

    shape = tuple(rnd.randint(1, 6) for _ in range(rnd.randint(1, 3)))
    regions = []
    for _ in range(rnd.randint(2, 5)):
        starts, lengths = random_box(rnd, shape)
        region = box(shape, starts, lengths)
        sizes, strides = [], []
        for n, stride in zip(region.sizes, region.strides):
            if n % 2 == 0 and rnd.random() < 0.5:  # a dim split in (n / 2, 2), as the pieces' row blocks are
                sizes += [n // 2, 2]
                strides += [2 * stride, stride]
            else:
                sizes.append(n)
                strides.append(stride)
        regions.append(ir.Region(region.offset, tuple(sizes), tuple(strides)))
    width = max(len(r.sizes) for r in regions)
    elements = [
        set(torch.arange(math.prod(shape)).as_strided(r.sizes, r.strides, r.offset).reshape(-1).tolist())
        for r in regions
    ]
    want = [any(elements[i] & elements[j] for j in range(len(regions)) if j != i) for i in range(len(regions))]
    got = overlapping_writes(
        np.zeros(len(regions), dtype=np.int64),
        np.asarray([r.offset for r in regions]),
        np.asarray([r.sizes + (1,) * (width - len(r.sizes)) for r in regions]),
        np.asarray([r.strides + (0,) * (width - len(r.strides)) for r in regions]),
        np.asarray([shape] * len(regions)),
    )
    assert got.tolist() == want


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(1, 4), st.integers(0, 3), st.randoms(use_true_random=False))
def test_per_expert_writes_from_a_stacked_source_coalesce(experts, inter, hidden, rank, rnd):
    # vLLM's loader copies a stacked checkpoint tensor (Qwen3.5's experts.gate_up_proj [E, 2I, H]) one expert at a time
    # into w13 [E, 2i, H] (TP rank's rows i of the gate half, then of the up half); some experts may be missing (EP).
    # The writes of one half coalesce into one write per run of consecutive experts, writing exactly the same bytes.
    tp = 4
    i = inter
    big = (experts, 2 * i * tp, hidden)
    params = (ir.TensorMeta("w13", (experts, 2 * i, hidden), "float32"),)
    kept = sorted(rnd.sample(range(experts), rnd.randint(1, experts)))
    writes = []
    for e in kept:
        for half in (0, 1):
            dst = box(params[0].shape, (e, half * i, 0), (1, i, hidden))
            src = box(big, (e, half * i * tp + rank * i, 0), (1, i, hidden))
            writes.append(ir.Write("w13", dst, ir.View(ir.Source("gate_up_proj"), src)))
    rnd.shuffle(writes)
    free, ordered = compile_writes(writes)
    assert not ordered
    runs = 1 + sum(1 for a, b in zip(kept, kept[1:]) if b != a + 1)
    assert len(free) <= 2 * runs  # fewer where gate and up rows also step alike (i = 1)
    sources = {"gate_up_proj": ir.TensorMeta("gate_up_proj", big, "float32")}
    want = reference(ir.RankPlan(0, params, tuple(writes)), sources, rank)
    assert bitwise_equal(reference(ir.RankPlan(0, params, tuple(free)), sources, rank), want)
