"""Replay + pack (trainer) and apply (consumer) against the reference interpreter, bit for bit.

Plans are synthesized by hypothesis: random source shapes, random view chains on meta tensors (narrow, transpose,
unsqueeze, expand, select, stepped slices) whose storage_offset/sizes/strides become regions, fused destinations
(several sources stacked or concatenated into one param, permuted destination views, broadcast copies), overlapping
writes (last write wins), dtype conversions, and Call/Full/Update leaves. Destinations start as NaN: every element the
plan covers must equal the reference's bits, every other element must still be NaN.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_worlds import NAN, assert_matches_reference, bits_equal, neg_exp, random_tensors, reference_params, worlds

from shardplan.errors import DisallowedOpError, MissingTensorError, PlanError, ReplayError, ShardplanError
from shardplan.plan import ir
from shardplan.plan.interp import resolve_op, to_dtype, write_source
from shardplan.plan.names import base_group, group_order
from shardplan.plan.overlap import overlap_levels
from shardplan.runtime.apply import Applier, FallbackRequiredError, LayoutMismatchError, params_from_plan
from shardplan.runtime.pack import PackLayout
from shardplan.runtime.replay import Replayer
from shardplan.runtime.tensors import (
    PackBufferError,
    StaleBindingError,
    TensorDTypeError,
    TensorLayoutError,
    TensorShapeError,
    collapse,
    widen,
)


# ---- properties -------------------------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.integers(0, 2**31 - 1), st.booleans(), st.sampled_from([16, 64, 256]))
def test_pack_apply_equals_reference(world, seed, flat, alignment):
    plans, sources = world
    tensors = random_tensors(sources, seed, flat)
    replayer = Replayer(plans, sources, alignment=alignment)
    buffer = replayer.bind(tensors).pack()
    # the batched pack against the plan's meaning, segment by segment (the reference interpreter), padding zero
    by_rank = {p.rank: p for p in plans}
    expected = torch.zeros(replayer.layout.nbytes, dtype=torch.uint8)
    for seg in replayer.layout.segments:
        if seg.nbytes:
            w, dtype = by_rank[seg.refs[0].rank].writes[seg.refs[0].index], to_dtype(seg.dtype)
            expected[seg.offset : seg.offset + seg.nbytes].view(dtype).view(seg.shape).copy_(
                write_source(w, dtype, tensors)
            )
    assert torch.equal(buffer, expected), "the batched pack differs from the reference interpreter's bytes"
    for plan in plans:
        params = params_from_plan(plan, fill=NAN)
        applier = Applier(plan, replayer.layout, params)
        applier.apply(buffer)
        assert_matches_reference(plan, applier, params, tensors)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(max_ranks=2), st.integers(0, 2**31 - 1), st.sampled_from([None, 1, 300, 2048]))
def test_groups_pack_and_apply_independently(world, seed, max_group_bytes):
    """Packing group by group into group-sized buffers gives the full buffer's bytes; applying them gives the same
    params; a group needs only its own sources. Also with groups split into parts (max_group_bytes): the parts
    tile their group, in group_order, each over the limit by less than one segment, offsets unchanged."""
    plans, sources = world
    tensors = random_tensors(sources, seed)
    replayer = Replayer(plans, sources, max_group_bytes=max_group_bytes)
    whole = PackLayout.from_plans(plans)
    layout = replayer.layout
    assert [(s.offset, s.nbytes, s.refs) for s in layout.segments] == [
        (s.offset, s.nbytes, s.refs) for s in whole.segments
    ] and layout.nbytes == whole.nbytes
    assert list(layout.group_names) == sorted(layout.group_names, key=group_order)
    for g in whole.groups:
        parts = [p for p in layout.groups if base_group(p.name) == g.name]
        assert (parts[0].start, parts[0].first, parts[-1].stop, parts[-1].last) == (g.start, g.first, g.stop, g.last)
        assert all(a.stop == b.start and a.last == b.first for a, b in zip(parts, parts[1:]))
        if max_group_bytes is not None and len(parts) > 1:
            for p in parts:  # about equal parts: over the limit by less than one of its segments
                segs = layout.segments[p.first : p.last]
                assert segs[-1].offset + segs[-1].nbytes - p.start <= max_group_bytes + max(x.nbytes for x in segs)
        elif max_group_bytes is not None:
            assert g.nbytes <= max_group_bytes or g.last - g.first == 1 or parts[0].name == g.name
    full = replayer.pack(tensors)
    for plan in plans:
        params = params_from_plan(plan, fill=NAN)
        applier = Applier(plan, replayer.layout, params)
        for span in replayer.layout.groups:
            needed = replayer.sources_read(span.name)
            buf = replayer.pack_group(span.name, {n: tensors[n] for n in needed})
            assert torch.equal(buf, full[span.start : span.stop])
            applier.apply_group(span.name, buf)
        assert applier.applied_groups == set(replayer.layout.group_names)
        assert_matches_reference(plan, applier, params, tensors)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(max_ranks=2), st.integers(0, 2**31 - 1), st.data())
def test_subset_packs_only_its_segments_at_their_offsets(world, seed, data):
    """Replayer.subset (a trainer serving part of a group): its segments' bytes as in the full pack, at the same
    offsets; every other byte of the buffer untouched."""
    plans, sources = world
    tensors = random_tensors(sources, seed)
    replayer = Replayer(plans, sources)
    full = replayer.pack(tensors)
    n = len(replayer.layout.segments)
    chosen = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n), label="segments")) if n else []
    out = torch.full((replayer.layout.nbytes,), 0xAB, dtype=torch.uint8)
    replayer.subset(chosen).bind(tensors, out).pack()
    mask = torch.zeros(replayer.layout.nbytes, dtype=torch.bool)
    for i in chosen:
        seg = replayer.layout.segments[i]
        mask[seg.offset : seg.offset + seg.nbytes] = True
    assert torch.equal(out[mask], full[mask])
    assert (out[~mask] == 0xAB).all()
    with pytest.raises(PlanError, match=f"segments \\[{n}\\] are not in this layout"):
        replayer.subset([n])


@settings(max_examples=40, deadline=None)
@given(worlds(computed=False), st.sampled_from([16, 256, 4096]))
def test_layout_invariants(world, alignment):
    plans, _ = world
    layout = PackLayout.from_plans(plans, alignment)
    assert layout == PackLayout.from_plans(plans, alignment)  # deterministic
    assert layout.digest == PackLayout.from_plans(plans, alignment).digest
    refs = [(r.rank, r.index) for s in layout.segments for r in s.refs]
    assert sorted(refs) == sorted((p.rank, i) for p in plans for i in range(len(p.writes)))  # each write once
    end = 0
    for s in layout.segments:
        assert s.offset % alignment == 0 and s.offset >= end  # aligned, no overlap, in order
        end = s.offset + s.nbytes
        writes = [next(p for p in plans if p.rank == r.rank).writes[r.index] for r in s.refs]
        assert len({(w.src, w.dst.sizes) for w in writes}) == 1  # shared only when the bytes are identical
    assert layout.nbytes >= end
    for g in layout.groups:
        assert all(s.group == g.name for s in layout.segments[g.first : g.last])
        assert g.start % alignment == 0
    # identical bytes are never packed twice (within a group)
    keys = [
        (s.group, w.src, s.dtype, s.shape)
        for s in layout.segments
        for w in [next(p for p in plans if p.rank == s.refs[0].rank).writes[s.refs[0].index]]
    ]
    assert len(keys) == len(set(keys))


def test_replicated_writes_share_one_segment():
    params = (ir.TensorMeta("model.norm.weight", (8,), "bfloat16"),)
    write = ir.Write(
        "model.norm.weight", ir.full_region((8,)), ir.View(ir.Source("model.norm.weight"), ir.full_region((8,)))
    )
    plans = [ir.RankPlan(r, params, (write,)) for r in range(4)]
    layout = PackLayout.from_plans(plans)
    assert len(layout.segments) == 1 and len(layout.segments[0].refs) == 4
    assert all(layout.rank_ranges(r) == [(0, 16)] for r in range(4))
    # a different destination dtype is different bytes
    fp32 = ir.RankPlan(9, (ir.TensorMeta("model.norm.weight", (8,), "float32"),), (write,))
    assert len(PackLayout.from_plans(plans + [fp32]).segments) == 2


def test_stacked_experts_pack_in_one_copy_per_storage():
    """Trainer experts stored as [E, I, H] stacks (HF names are views): each stack is packed by one strided copy."""
    num_experts, inter, hidden, tp_rows = 6, 8, 16, 2
    sources, writes = {}, []
    params = (ir.TensorMeta("model.layers.0.mlp.experts.w13_weight", (num_experts, 2 * tp_rows, hidden), "bfloat16"),)
    for e in range(num_experts):
        for k, proj in enumerate(["gate_proj", "up_proj"]):
            name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
            sources[name] = ir.TensorMeta(name, (inter, hidden), "bfloat16")
            dst = ir.Region((e * 2 + k) * tp_rows * hidden, (tp_rows, hidden), (hidden, 1))
            src = ir.Region(2 * hidden, (tp_rows, hidden), (hidden, 1))
            writes.append(ir.Write(params[0].name, dst, ir.View(ir.Source(name), src)))
    plan = ir.RankPlan(0, params, tuple(writes))
    stacks = {proj: torch.randn(num_experts, inter, hidden).to(torch.bfloat16) for proj in ["gate_proj", "up_proj"]}
    tensors = {n: stacks[n.split(".")[-2]][int(n.split(".")[5])] for n in sources}
    replayer = Replayer(plan, sources)
    bound = replayer.bind(tensors)
    assert bound.num_launches == 2  # one per stack, not one per expert
    params_t = params_from_plan(plan, fill=NAN)
    applier = Applier(plan, replayer.layout, params_t)
    assert applier.num_launches == 1  # w13 rows land at one constant stride
    applier.apply(bound.pack())
    assert_matches_reference(plan, applier, params_t, tensors)
    separate = {n: t.clone() for n, t in tensors.items()}  # separate storages: one stack per batch instead
    assert replayer.bind(separate).num_launches == 1


def test_overlapping_writes_keep_plan_order():
    """Two writes to the same rows: the later one must win even though layout order and batching differ."""
    src = {n: ir.TensorMeta(n, (4, 4), "float32") for n in ("layers.0.a", "layers.0.b")}
    params = (ir.TensorMeta("layers.0.p", (4, 4), "float32"),)
    writes = (
        ir.Write("layers.0.p", ir.full_region((4, 4)), ir.View(ir.Source("layers.0.b"), ir.full_region((4, 4)))),
        ir.Write(
            "layers.0.p", ir.Region(4, (2, 4), (4, 1)), ir.View(ir.Source("layers.0.a"), ir.Region(0, (2, 4), (4, 1)))
        ),
        ir.Write(
            "layers.0.p", ir.Region(8, (1, 4), (4, 1)), ir.View(ir.Full(5.0, (1, 4), "float32"), ir.full_region((1, 4)))
        ),
    )
    plan = ir.RankPlan(0, params, writes)
    tensors = random_tensors(src, 0)
    replayer = Replayer(plan, src)
    params_t = params_from_plan(plan, fill=NAN)
    applier = Applier(plan, replayer.layout, params_t)
    applier.apply(replayer.pack(tensors))
    assert_matches_reference(plan, applier, params_t, tensors)
    assert (params_t["layers.0.p"][2] == 5).all()


def test_overlap_levels():
    levels = overlap_levels(
        [("p", 0, 10, 0), ("p", 10, 20, 1), ("p", 5, 15, 2), ("q", 0, 10, 3), ("p", 0, 1, 4), ("p", 6, 7, 5)]
    )
    assert levels == {0: 0, 1: 0, 2: 1, 3: 0, 4: 1, 5: 2}


def test_geometry_helpers():
    assert collapse((2, 1, 3, 4), (12, 99, 4, 1)) == ((24,), (1,))
    assert collapse((4, 8), (16, 1)) == ((4, 8), (16, 1))
    assert collapse((), ()) == ((1,), (1,))
    assert widen(2, (4, 8), (16, 1), [0, 64]) == (8, (4, 2), (4, 1))
    assert widen(2, (4, 6), (16, 1), [0]) == (4, (4, 3), (8, 1))
    assert widen(2, (4, 8), (16, 1), [2]) == (2, (4, 8), (16, 1))  # misaligned address: no widening
    assert widen(2, (4, 8), (16, 2), [0]) == (2, (4, 8), (16, 2))


# ---- bad input: named errors naming the tensor and what the plan expected -------------------------------------------
def _small():
    src = {"layers.0.w": ir.TensorMeta("layers.0.w", (4, 6), "bfloat16")}
    params = (ir.TensorMeta("layers.0.p", (2, 6), "float32"),)
    rows = ir.View(ir.Source("layers.0.w"), ir.Region(6, (2, 6), (6, 1)))
    write = ir.Write("layers.0.p", ir.full_region((2, 6)), rows)
    return ir.RankPlan(0, params, (write,)), src


@pytest.mark.parametrize(
    "tensor, error, words",
    [
        (None, MissingTensorError, ["layers.0.w", "missing", "bfloat16[4, 6]"]),
        (torch.zeros(4, 5, dtype=torch.bfloat16), TensorShapeError, ["layers.0.w", "[4, 5]", "bfloat16[4, 6]"]),
        (torch.zeros(4, 6, dtype=torch.float16), TensorDTypeError, ["layers.0.w", "float16", "bfloat16[4, 6]"]),
        (torch.zeros(6, 4, dtype=torch.bfloat16).t(), TensorLayoutError, ["layers.0.w", "contiguous"]),
    ],
)
def test_bad_trainer_tensor(tensor, error, words):
    plan, src = _small()
    tensors = {} if tensor is None else {"layers.0.w": tensor}
    with pytest.raises(error) as info:
        Replayer(plan, src).pack(tensors)
    assert issubclass(error, ShardplanError)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "param, error",
    [
        (None, MissingTensorError),
        (torch.zeros(3, 6), TensorShapeError),
        (torch.zeros(2, 6, dtype=torch.float64), TensorDTypeError),
    ],
)
def test_bad_param(param, error):
    plan, src = _small()
    layout = PackLayout.from_plans(plan)
    with pytest.raises(error, match="layers.0.p"):
        Applier(plan, layout, {} if param is None else {"layers.0.p": param})


def test_disallowed_op_and_resolution():
    assert resolve_op("Tensor.reshape") is torch.Tensor.reshape
    assert resolve_op("torch.cat") is torch.cat
    for name in ["Tensor.item", "os.system", "torch.load", "Tensor.__reduce_ex__"]:
        with pytest.raises(DisallowedOpError, match="ALLOWED_OPS"):
            resolve_op(name)
    plan, src = _small()
    bad = ir.Write(
        "layers.0.p",
        ir.full_region((2, 6)),
        ir.View(
            ir.Call("torch.load", (ir.Arg(0),), (), (ir.View(ir.Source("layers.0.w"), ir.full_region((4, 6))),)),
            ir.Region(0, (2, 6), (6, 1)),
        ),
    )
    with pytest.raises(DisallowedOpError):
        Replayer(ir.RankPlan(0, plan.params, (bad,)), src)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_exp_replays_as_the_mamba_loader_computes_it(dtype):
    # what vLLM's A_weight_loader writes, `-torch.exp(A_log.float())`, split per TP rank: the reference interpreter and
    # the replay runtime (pack + apply) give its bits, special values (inf, -inf, nan, -0.0) included
    a_log = (
        torch.cat(
            [
                torch.randn(14, generator=torch.Generator().manual_seed(1)),
                torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 100.0]),
            ]
        )
        .to(getattr(torch, dtype))
        .reshape(4, 5)
    )
    src = {"A_log": ir.TensorMeta("A_log", (4, 5), dtype)}
    call = neg_exp(ir.View(ir.Source("A_log"), ir.full_region((4, 5))), (4, 5))
    for rank in (0, 1):
        want = (-torch.exp(a_log.float())).split(2, dim=0)[rank]
        plan = ir.RankPlan(
            rank,
            (ir.TensorMeta("A", (2, 5), "float32"),),
            (ir.Write("A", ir.full_region((2, 5)), ir.View(call, ir.Region(10 * rank, (2, 5), (5, 1)))),),
        )
        ref = reference_params(plan, {"A_log": a_log})["A"]
        replayer = Replayer(plan, src)
        params = params_from_plan(plan, fill=NAN)
        Applier(plan, replayer.layout, params).apply(replayer.bind({"A_log": a_log}).pack())
        assert bits_equal(ref, want) and bits_equal(params["A"], want)


def test_plan_errors():
    plan, src = _small()
    out_of_bounds = ir.Write(
        "layers.0.p", ir.full_region((2, 6)), ir.View(ir.Source("layers.0.w"), ir.Region(20, (2, 6), (6, 1)))
    )
    with pytest.raises(PlanError, match="layers.0.w"):
        Replayer(ir.RankPlan(0, plan.params, (out_of_bounds,)), src)
    with pytest.raises(PlanError, match="sources table"):
        Replayer(plan, {})
    with pytest.raises(PlanError, match="distinct"):
        Replayer([plan, plan], src)
    dst_out_of_bounds = ir.RankPlan(
        0, plan.params, (ir.Write("layers.0.p", ir.Region(6, (2, 6), (6, 1)), plan.writes[0].src),)
    )
    with pytest.raises(PlanError, match="layers.0.p"):
        Applier(dst_out_of_bounds, PackLayout.from_plans(dst_out_of_bounds), params_from_plan(dst_out_of_bounds))


def test_buffer_binding_and_layout_errors():
    plan, src = _small()
    tensors = {"layers.0.w": torch.randn(4, 6).to(torch.bfloat16)}
    replayer = Replayer(plan, src)
    with pytest.raises(PackBufferError, match="bytes"):
        replayer.pack(tensors, out=torch.empty(3, dtype=torch.uint8))
    bound = replayer.bind(tensors)
    tensors["layers.0.w"].data = torch.randn(4, 6).to(torch.bfloat16)  # reallocated behind the binding's back
    with pytest.raises(StaleBindingError, match="layers.0.w"):
        bound.pack()
    other = ir.RankPlan(5, plan.params, plan.writes)
    with pytest.raises(LayoutMismatchError, match="rank 5"):
        Applier(other, replayer.layout, params_from_plan(other))
    params = params_from_plan(plan)
    with pytest.raises(PackBufferError):
        Applier(plan, replayer.layout, params).apply(torch.empty(7, dtype=torch.uint8))


def test_cuda_graph_needs_cuda():
    plan, src = _small()
    tensors = {"layers.0.w": torch.randn(4, 6).to(torch.bfloat16)}
    bound = Replayer(plan, src).bind(tensors)  # default: graphs only on CUDA, eager here
    assert bound.graph_error is None and bound.num_launches == 1
    with pytest.raises(ReplayError, match="CUDA"):
        Replayer(plan, src).bind(tensors, cuda_graph=True)


def test_fallbacks_need_a_loader():
    plan, src = _small()
    fb = ir.Fallback("layers.0.scale", "Tensor.item", "reads values", "vllm.x.loader")
    plan = ir.RankPlan(0, plan.params, plan.writes, fallbacks=(fb,))
    layout = PackLayout.from_plans(plan)
    with pytest.raises(FallbackRequiredError, match="layers.0.scale"):
        Applier(plan, layout, params_from_plan(plan))
    loaded = []
    applier = Applier(plan, layout, params_from_plan(plan), fallback_loader=lambda n, t: loaded.append((n, t)))
    with pytest.raises(MissingTensorError, match="layers.0.scale"):
        applier.apply_fallbacks({})
    applier.apply_fallbacks({"layers.0.scale": torch.ones(1)})
    assert [n for n, _ in loaded] == ["layers.0.scale"]


def test_from_model_uses_parameters_and_buffers():
    plan, src = _small()
    model = torch.nn.Module()
    model.register_parameter("p", torch.nn.Parameter(torch.full((2, 6), NAN)))
    renamed = ir.RankPlan(
        0, (ir.TensorMeta("p", (2, 6), "float32"),), tuple(ir.Write("p", w.dst, w.src) for w in plan.writes)
    )
    layout = PackLayout.from_plans(renamed)
    tensors = {"layers.0.w": torch.randn(4, 6).to(torch.bfloat16)}
    Applier.from_model(renamed, layout, model).apply(Replayer(renamed, src).pack(tensors))
    assert torch.equal(model.p.detach(), tensors["layers.0.w"][1:3].float())


def test_param_given_new_storage_is_noticed_at_the_next_apply():
    """`param.data = new` between two applies (an engine re-allocating its weights): the second apply writes the new
    storage, not the old one the first apply's bound views pointed at; a new storage of the wrong shape is named."""
    plan, src = _small()
    model = torch.nn.Module()
    model.register_parameter("p", torch.nn.Parameter(torch.full((2, 6), NAN), requires_grad=False))
    renamed = ir.RankPlan(
        0, (ir.TensorMeta("p", (2, 6), "float32"),), tuple(ir.Write("p", w.dst, w.src) for w in plan.writes)
    )
    layout = PackLayout.from_plans(renamed)
    tensors = {"layers.0.w": torch.randn(4, 6).to(torch.bfloat16)}
    buffer = Replayer(renamed, src).pack(tensors)
    applier = Applier.from_model(renamed, layout, model)
    applier.apply(buffer)
    old = model.p.data
    model.p.data = torch.full((2, 6), NAN)
    applier.apply(buffer)
    assert torch.equal(model.p.detach(), tensors["layers.0.w"][1:3].float())
    assert model.p.data_ptr() != old.data_ptr()
    model.p.data = torch.full((3, 6), NAN)
    with pytest.raises(TensorShapeError, match="'p'"):
        applier.apply(buffer)


def test_devices_compare_by_what_they_resolve_to(monkeypatch):
    """ "cuda" and torch.device("cuda") mean the current CUDA device (as a tensor there reports it, cuda:N) wherever a
    device is checked; the error names the resolution and what was given. (CUDA stands in by its current-device
    query here; tests/gpu checks real CUDA tensors.)"""
    from shardplan.runtime.quantize import QuantizingReplayer
    from shardplan.runtime.tensors import describe_device, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0) and resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) is None
    assert describe_device("cuda") == "cuda:1 (the current device, given as 'cuda')"
    assert describe_device("cuda:0") == "cuda:0"
    plan, src = _small()
    tensors = {"layers.0.w": torch.randn(4, 6).to(torch.bfloat16)}
    with pytest.raises(
        TensorLayoutError,
        match=r"'layers.0.w' is on cpu, expected cuda:1 \(the current device, "
        r"given as 'cuda'\)",
    ):
        Replayer(plan, src, device="cuda").bind(tensors)
    w = "layers.0.q.weight"
    sources = {
        w: ir.TensorMeta(w, (128, 128), "float8_e4m3fn"),
        w + "_scale_inv": ir.TensorMeta(w + "_scale_inv", (1, 1), "float32"),
    }
    qplan = ir.RankPlan(
        0,
        (ir.TensorMeta("q", (128, 128), "float8_e4m3fn"),),
        (ir.Write("q", ir.full_region((128, 128)), ir.View(ir.Source(w), ir.full_region((128, 128)))),),
    )
    with pytest.raises(TensorLayoutError, match=rf"'{w}' is on cpu, expected cuda:1 \(the current device"):
        QuantizingReplayer(
            qplan, sources, quantizer="fp8-e4m3-block-amax448-v1/128x128", device=torch.device("cuda")
        ).bind({w: torch.zeros(128, 128, dtype=torch.bfloat16)})
    assert Replayer(plan, src, device="cpu").pack(tensors).device == torch.device("cpu")


@pytest.mark.parametrize("change", ["in place", "fresh tensor", "data swapped", "set_", "same address, new view"])
def test_sync_binding_cache_never_packs_stale(change):
    """The sync packer's cached binding (sync/adapters._Packs) packs what the source hands *this* sync: an in-place
    update through the bound binding, anything else (a fresh object, a bound object whose storage was swapped in
    place) by a new bind, never the bytes of the old storage."""
    from shardplan.sync.adapters import _Packs

    plan, src = _small()
    replayer = Replayer(plan, src)
    out = torch.zeros(replayer.layout.nbytes, dtype=torch.uint8)
    tensors = {"layers.0.w": torch.randn(4, 6).to(torch.bfloat16)}
    packs = _Packs()
    packs.run("k", replayer, range(len(replayer.layout.segments)), tensors, out)
    packs.run("k", replayer, range(len(replayer.layout.segments)), tensors, out)  # cached from here on
    bound = next(iter(packs.bound.values()))[3][out.data_ptr()]
    new = torch.randn(4, 6).to(torch.bfloat16)
    w = tensors["layers.0.w"]
    if change == "in place":
        w.copy_(new)
    elif change == "fresh tensor":
        tensors = {"layers.0.w": new.clone()}
    elif change == "data swapped":
        w.data = new.clone()
    elif change == "set_":
        w.set_(new.clone())
    else:  # a new object over the bound storage: the binding still reads the right bytes
        w.copy_(new)
        tensors = {"layers.0.w": w.view(4, 6)}
    packs.run("k", replayer, range(len(replayer.layout.segments)), tensors, out)
    assert torch.equal(out, replayer.pack({"layers.0.w": new}))
    cached = next(iter(packs.bound.values()))[3].get(out.data_ptr())
    assert (cached is bound) == (change in ("in place", "same address, new view"))
