"""The columnar form (plan/columns.py, plan/file/rank.py, runtime/segments.py) equals the object form: instantiated
writes, pack layouts (segments, refs, groups, split parts) and their digests, for every shipped plan and for random
plans; and its checks refuse what the object path refused."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from plan_worlds import plan_file_of, worlds
from reference import rank_objects, reference_layout

from shardplan.errors import PlanError
from shardplan.plan import ir
from shardplan.plan.body import SourceTable
from shardplan.plan.columns import LazyWrites, NameSourceIds, WriteColumns, columns_of, table_ids
from shardplan.plan.file.format import PlanBoundsError, PlanFile, PlanFileError
from shardplan.runtime.apply import Applier, LayoutMismatchError
from shardplan.runtime.pack import PackLayout, SegmentTable
from shardplan.runtime.replay import Replayer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANS = sorted(glob.glob(os.path.join(ROOT, "plans", "*.plan")))
BIG = ("kimi-k2--tp32--", "qwen3-next", "qwen3-235b-a22b--tp8--", "qwen3-30b")  # ~20-75k writes per rank


def _assert_same_layout(layout: PackLayout, plans, alignment=256, max_group_bytes=None) -> None:
    nbytes, segments, groups = reference_layout(plans, alignment, max_group_bytes)
    assert layout.nbytes == nbytes
    assert [(g.name, g.start, g.stop, g.first, g.last) for g in layout.groups] == [tuple(g) for g in groups]
    assert len(layout.segments) == len(segments)
    assert all(a == b for a, b in zip(layout.segments, segments))


def _meta_params(plan):
    return {p.name: torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta") for p in plan.params}


@pytest.mark.slow  # subprocesses / whole shipped plans: `make test`, not `make test-fast`
@pytest.mark.parametrize("path", PLANS, ids=[os.path.basename(p) for p in PLANS])
def test_shipped_plans_columnar_equals_objects(path):
    plan_file = PlanFile.read(path)
    ranks = plan_file.ranks
    big = any(b in path for b in BIG)
    sample = [ranks[-1]] if big else sorted({ranks[0], ranks[-1]})
    for rank in sample:
        plan, objects = plan_file.rank(rank), rank_objects(plan_file, rank)
        assert isinstance(plan.writes, LazyWrites) and len(plan.writes) == len(objects.writes)
        assert plan.params == objects.params and plan.fallbacks == objects.fallbacks
        assert plan.writes == objects.writes and plan.writes[-1] == objects.writes[-1]
        layout = PackLayout.from_plans(plan)
        _assert_same_layout(layout, [objects])
        # the same layout from the object plan (columns built from ir.Write objects) has the same digest
        assert PackLayout.from_plans(objects).digest == layout.digest
        if not big:
            _assert_same_layout(PackLayout.from_plans(plan, 256, 1 << 22), [objects], 256, 1 << 22)
        replayer = Replayer(plan, plan_file.sources)
        assert replayer.layout.digest == layout.digest
        applier = Applier(plan, replayer.layout, _meta_params(plan))
        assert len(applier._items) == sum(1 for s in layout.segments for r in s.refs if s.nbytes)
    if len(ranks) > 1 and not big:
        pair = [plan_file.rank(r) for r in ranks[:2]]
        _assert_same_layout(PackLayout.from_plans(pair), [rank_objects(plan_file, r) for r in ranks[:2]])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.sampled_from([16, 256]), st.sampled_from([None, 1, 300, 2048]), st.sampled_from([0, 1, 64]))
def test_random_plans_columnar_equals_objects(world, alignment, max_group_bytes, small):
    from shardplan.plan.file import rank as planrank

    plans, sources = world
    plans = [ir.RankPlan(i, p.params, p.writes) for i, p in enumerate(plans)]  # plan files number ranks from 0
    before = planrank._SMALL  # templates of up to `small` writes are instantiated batched (0: none, 1: some)
    planrank._SMALL = small
    try:
        _check_random_plans(plans, sources, alignment, max_group_bytes)
    finally:
        planrank._SMALL = before


def _check_random_plans(plans, sources, alignment, max_group_bytes):
    try:
        plan_file = plan_file_of(plans, sources)
    except PlanFileError:  # e.g. a generated constant fill larger than its param: the writer refuses such plans
        assume(False)
    objects = []
    for p in plans:
        try:
            objects.append(rank_objects(plan_file, p.rank))
        except PlanBoundsError as e:  # refused by the object path: the columnar one refuses it too
            with pytest.raises(type(e)):
                plan_file.rank(p.rank)
            return
    columnar = [plan_file.rank(p.rank) for p in plans]
    for c, o in zip(columnar, objects):
        assert c.writes == o.writes and c.params == o.params
    layout = PackLayout.from_plans(columnar, alignment, max_group_bytes)
    _assert_same_layout(layout, objects, alignment, max_group_bytes)
    assert layout.digest == PackLayout.from_plans(objects, alignment, max_group_bytes).digest
    # plans given as objects (recorded, not read from a file) take the same columnar path
    _assert_same_layout(PackLayout.from_plans(plans, alignment, max_group_bytes), plans, alignment, max_group_bytes)


def test_lazy_writes_behave_like_a_tuple():
    plan_file = PlanFile.read(os.path.join(ROOT, "plans", "llama-3.1-8b--tp2--bfloat16.plan"))
    plan, objects = plan_file.rank(1), rank_objects(plan_file, 1)
    writes = plan.writes
    assert len(writes) == len(objects.writes) and writes._all is None  # nothing built yet
    assert writes[0] == objects.writes[0] and writes[-1] == objects.writes[-1] and writes._all is None
    with pytest.raises(IndexError, match="291 writes"):
        writes[len(writes)]
    assert writes[2:5] == objects.writes[2:5]
    assert writes == objects.writes and objects.writes == writes and hash(writes) == hash(objects.writes)
    assert plan == objects and tuple(writes) + () == objects.writes
    assert "291 writes" in repr(writes)


def test_source_ids_number_every_name_without_spelling_them():
    metas = [
        ir.TensorMeta(f"model.layers.{i}.mlp.experts.{e}.w1.weight", (4, 2), "bfloat16")
        for i in range(3)
        for e in range(0, 20, 3)
    ] + [ir.TensorMeta("model.norm.weight", (4,), "float32")]
    table = SourceTable.from_metas(metas)
    ids = table_ids(table)
    assert table_ids(table) is ids  # built once per table
    got = ids.ids_of_names(m.name for m in metas)
    assert sorted(got.tolist()) == list(range(len(metas)))
    assert [ids.name(int(i)) for i in got] == [m.name for m in metas]
    assert ids.numels(got).tolist() == [m.numel for m in metas]
    text = "model.layers.{}.mlp.experts.{}.w1.weight"
    missing = ids.ids(text, np.asarray([[0, 1], [3, 0], [-1, 0], [2, 18], [1 << 40, 0]]))
    assert missing.tolist()[:2] == [-1, -1] and missing[2] == -1 and missing[3] >= 0 and missing[4] == -1
    assert ids.ids("model.other.{}.weight", np.asarray([[0]])).tolist() == [-1]
    assert NameSourceIds(["a", "b"]).ids_of_names(["b", "c"]).tolist() == [1, -1]
    # a sparse index: a query inside the rows' bounding box that no row has (its key past the largest present one)
    sparse = table_ids(
        SourceTable.from_metas(
            [
                ir.TensorMeta("model.layers.0.x.5.w", (2,), "bfloat16"),
                ir.TensorMeta("model.layers.3.x.0.w", (2,), "bfloat16"),
            ]
        )
    )
    got = sparse.ids("model.layers.{}.x.{}.w", np.asarray([[3, 5], [0, 5], [3, 0], [0, 0], [1, 1]]))
    assert got.tolist() == [-1, 0, 1, -1, -1]


def _small_plan():
    params = (ir.TensorMeta("model.layers.0.w.weight", (4, 4), "bfloat16"),)
    writes = (
        ir.Write(
            "model.layers.0.w.weight",
            ir.full_region((4, 4)),
            ir.View(ir.Source("model.layers.0.w.weight"), ir.Region(16, (4, 4), (4, 1))),
        ),
    )
    return ir.RankPlan(1, params, writes)


def test_replayer_checks_columns_against_the_trainers_sources():
    plan = _small_plan()
    with pytest.raises(PlanError, match="reads 'model.layers.0.w.weight', which the sources table does not"):
        Replayer(plan, {"model.other": ir.TensorMeta("model.other", (8, 4), "bfloat16")})
    with pytest.raises(PlanBoundsError, match=r"reads elements \[16, 32\) of 'model.layers.0.w.weight', which has 24"):
        Replayer(plan, {"model.layers.0.w.weight": ir.TensorMeta("model.layers.0.w.weight", (6, 4), "bfloat16")})
    Replayer(plan, {"model.layers.0.w.weight": ir.TensorMeta("model.layers.0.w.weight", (8, 4), "bfloat16")})


def test_applier_refuses_a_layout_of_other_plans():
    plan = _small_plan()
    other = ir.RankPlan(1, (ir.TensorMeta("model.layers.0.w.weight", (4, 4), "float16"),), plan.writes)
    with pytest.raises(LayoutMismatchError, match="does not match the plan"):
        Applier(plan, PackLayout.from_plans(other), _meta_params(plan))
    with pytest.raises(LayoutMismatchError, match="not rank 1"):
        Applier(plan, PackLayout.from_plans(ir.RankPlan(0, plan.params, plan.writes)), _meta_params(plan))


def test_segment_table_round_trips_segment_objects():
    plan_file = PlanFile.read(os.path.join(ROOT, "plans", "llama-3.1-8b--tp2--bfloat16.plan"))
    layout = PackLayout.from_plans([plan_file.rank(0), plan_file.rank(1)])
    again = SegmentTable.from_segments(tuple(layout.segments))
    assert again == layout.segments and len(again) == len(layout.segments)
    rebuilt = PackLayout(layout.alignment, layout.nbytes, tuple(layout.segments), layout.groups, layout.ranks)
    assert rebuilt.digest == layout.digest
    assert layout.group(layout.groups[3].name).segments[0].offset == 0
    assert columns_of(plan_file.rank(0)) is plan_file.rank(0).writes.columns
    assert isinstance(WriteColumns.from_writes(plan_file.rank(0).params, list(plan_file.rank(0).writes)), WriteColumns)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 300), st.integers(1, 6), st.booleans())
def test_canonical_order_on_classes_equals_the_full_key_sort(seed, num_writes, num_classes, wide_offsets):
    """plan/file/rank.py sorts (param, offset) in one packed key and breaks ties by a rank of the geometry classes; the
    definition is a stable lexsort over (param name, offset, sizes, strides), regions padded with -1."""
    from shardplan.plan.file.rank import canonical_order

    rng = np.random.default_rng(seed)
    names = [f"p{i}" for i in rng.permutation(5)]
    ndim = rng.integers(1, 4, size=num_classes)
    sizes = np.ones((num_classes, 3), dtype=np.int64)
    strides = np.zeros((num_classes, 3), dtype=np.int64)
    for c in range(num_classes):
        sizes[c, : ndim[c]] = rng.integers(1, 3, size=ndim[c])
        strides[c, : ndim[c]] = rng.integers(0, 3, size=ndim[c])
    if num_classes > 1:  # two classes of one geometry: equal keys, the plan order decides
        ndim[-1], sizes[-1], strides[-1] = ndim[0], sizes[0], strides[0]
    offsets = rng.integers(0, 4, size=num_writes) * (1 << 59 if wide_offsets else 1)  # wide: past one packed key
    rows = {
        "param": rng.integers(0, len(names), size=num_writes),
        "dst_offset": offsets,
        "dst_class": rng.integers(0, num_classes, size=num_writes),
    }
    got = canonical_order(rows, (ndim, sizes, strides), names, num_writes)
    # rows out of plan order (small templates batched), their plan positions given: the same order of the writes
    moved = rng.permutation(num_writes)
    got_moved = canonical_order(
        {k: v[moved] for k, v in rows.items()}, (ndim, sizes, strides), names, num_writes, moved
    )
    assert moved[got_moved].tolist() == got.tolist()
    klass = rows["dst_class"]
    real = np.arange(3)[None, :] < ndim[klass][:, None]
    pad_sizes, pad_strides = np.where(real, sizes[klass], -1), np.where(real, strides[klass], -1)
    name_rank = np.argsort(np.argsort(np.asarray(names, dtype=object), kind="stable"), kind="stable")
    keys = [pad_strides[:, j] for j in (2, 1, 0)] + [pad_sizes[:, j] for j in (2, 1, 0)]
    want = np.lexsort(keys + [offsets, name_rank[rows["param"]]])
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("prop", ["dst_sizes", "dst_strides", "src_sizes", "src_strides", "dst_ndim", "src_ndim"])
def test_writes_after_one_geometry_property_was_gathered(prop):
    """A columnar rank keeps its geometry per class and gathers a per-write matrix only when a property asks: the
    writes read back afterwards must not assume the other matrices were gathered too (one property was read by
    runtime/shards.py's plan_shards before iterating the writes: KeyError ('dst', 0) in the end-to-end test)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "plans", "llama-3.1-8b--tp2--bfloat16.plan")
    plan_file = PlanFile.read(path)
    plan = plan_file.rank(1)
    assert isinstance(plan.writes, LazyWrites)
    getattr(plan.writes.columns, prop)
    assert tuple(plan.writes) == tuple(rank_objects(plan_file, 1).writes)
