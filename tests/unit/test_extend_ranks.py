"""Rank extension (plan/compile/extend.py, record/ranks.py) on synthetic plans shaped like vLLM loaders' (no vLLM):
whatever the layout and the rank dependence, the extended body encodes to the same bytes as compiling every rank's
plan."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardplan.plan import ir
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.compile.extend import FlatRank, Line, NotAffine, body_from_flat, flat_rank, sorted_rows
from shardplan.plan.file.format import encode
from shardplan.plan.layout import Layout
from shardplan.plan.template import build_trie, trie_from_rows
from shardplan.record.ranks import extend_ranks, rank_classes

COLS = 4


def _write(param, dst_offset, rows, src, src_offset):
    return ir.Write(
        param,
        ir.Region(dst_offset, (rows, COLS), (COLS, 1)),
        ir.View(ir.Source(src), ir.Region(src_offset, (rows, COLS), (COLS, 1))),
    )


def synthetic_plan(layout: Layout, rank: int, case: dict) -> tuple[ir.RankPlan, dict]:
    """What a loader does on `rank`: a TP-narrowed projection, a vocabulary split with padding rows on the last ranks,
    kv heads replicated when TP exceeds them, and (EP) linearly placed experts, the first ranks holding one more."""
    dp_rank, _, tp_rank = layout.coords(rank)
    shard, vocab, num_kv = case["shard"], case["vocab"], case["num_kv"]
    params, sources, writes = {}, {}, []

    def param(name, shape, dtype="bfloat16"):
        params[name] = ir.TensorMeta(name, shape, dtype)

    def source(name, shape, dtype="bfloat16"):
        sources[name] = ir.TensorMeta(name, shape, dtype)

    per_rank_vocab = -(-vocab // layout.tp)
    param("embed.weight", (per_rank_vocab, COLS))
    source("embed.weight", (vocab, COLS))
    start = tp_rank * per_rank_vocab
    real = max(0, min(per_rank_vocab, vocab - start))
    if real:
        writes.append(_write("embed.weight", 0, real, "embed.weight", start * COLS))
    if real < per_rank_vocab:  # padding rows: a constant write
        writes.append(
            ir.Write(
                "embed.weight",
                ir.Region(real * COLS, (per_rank_vocab - real, COLS), (COLS, 1)),
                ir.View(
                    ir.Full(0.0, (per_rank_vocab - real, COLS), "bfloat16"),
                    ir.full_region((per_rank_vocab - real, COLS)),
                ),
            )
        )
    for layer in range(case["num_layers"]):
        qkv = f"model.layers.{layer}.attn.qkv.weight"
        param(qkv, (2 * shard, COLS))
        q, k = f"model.layers.{layer}.attn.q.weight", f"model.layers.{layer}.attn.k.weight"
        source(q, (shard * layout.tp, COLS))
        source(k, (shard * max(num_kv, 1), COLS))
        writes.append(_write(qkv, 0, shard, q, tp_rank * shard * COLS))
        kv_head = tp_rank * num_kv // layout.tp if layout.tp >= num_kv else tp_rank
        writes.append(_write(qkv, shard * COLS, shard, k, kv_head * shard * COLS))
        if case["num_experts"]:
            ep_size = layout.tp * layout.dp if layout.ep else 1
            ep_rank = dp_rank * layout.tp + tp_rank if layout.ep else 0
            base, extra = divmod(case["num_experts"], ep_size)
            first = ep_rank * base + min(ep_rank, extra)
            local = base + (ep_rank < extra)
            w13 = f"model.layers.{layer}.experts.w13_weight"
            param(w13, (local, 2 * shard, COLS))
            tp_slice = 1 if layout.ep else layout.tp
            t = 0 if layout.ep else tp_rank
            for slot, e in enumerate(range(first, first + local)):
                gate = f"model.layers.{layer}.experts.{e}.gate.weight"
                source(gate, (shard * tp_slice, COLS))
                writes.append(_write(w13, slot * 2 * shard * COLS, shard, gate, t * shard * COLS))
    plan = ir.RankPlan(rank, tuple(params.values()), tuple(writes))
    return plan, sources


@st.composite
def layouts_and_cases(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    ep = draw(st.booleans())
    num_experts = draw(st.sampled_from([0, 5, 8, 12, 16]))
    assume(not ep or (num_experts and num_experts >= tp * dp))
    case = {
        "shard": draw(st.integers(1, 3)),
        "vocab": draw(st.integers(tp, 40)),
        "num_kv": draw(st.sampled_from([1, 2, 4, 8])),
        "num_layers": draw(st.integers(1, 3)),
        "num_experts": num_experts,
    }
    return Layout(tp=tp, dp=dp, ep=ep), case


def _bytes(body, layout):
    return encode(
        body, model="m", architecture="A", config_sha256="0" * 64, layout=layout, dtype="bfloat16", vllm_version="0"
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts_and_cases(), st.data())
def test_extended_body_is_byte_identical_to_compiling_every_rank(layout_case, data):
    layout, case = layout_case
    ranks = list(range(layout.world_size))
    if data.draw(st.booleans(), label="a subset of ranks"):
        ranks = sorted(data.draw(st.sets(st.sampled_from(ranks), min_size=1), label="ranks"))
    plans, sources = {}, {}
    for rank in ranks:
        plans[rank], s = synthetic_plan(layout, rank, case)
        sources.update(s)
    recorded = []

    def record(rank):
        recorded.append(rank)
        return flat_rank(plans[rank])

    ext = extend_ranks(layout, ranks, record, case["num_experts"])
    assert sorted(ext.flats) == ranks and sorted(recorded) == sorted(set(recorded))
    want = _bytes(compile_plans([plans[r] for r in ranks], list(sources.values())), layout)
    assert _bytes(body_from_flat(ext.flats, list(sources.values())), layout) == want


def test_few_ranks_are_recorded_where_the_layout_is_affine():
    """TP 8 x DP 4 with EP: a plane over (TP rank, DP rank) and its checks; DP replicas without EP: copies."""
    case = {"shard": 2, "vocab": 64, "num_kv": 64, "num_layers": 2, "num_experts": 64}
    for layout, most in [
        (Layout(tp=8, dp=4, ep=True), 4),
        (Layout(tp=8, dp=4), 4),
        (Layout(tp=1, dp=32, ep=True), 3),
        (Layout(tp=32, ep=True), 3),
    ]:
        ranks = list(range(layout.world_size))
        plans = {r: synthetic_plan(layout, r, case)[0] for r in ranks}
        recorded = []
        ext = extend_ranks(layout, ranks, lambda r: recorded.append(r) or flat_rank(plans[r]), case["num_experts"])
        assert len(recorded) <= most, (layout, recorded, ext.notes)
        assert not ext.notes
        for r in ranks:  # every prediction equals the plan the rank would record
            assert sorted_rows(ext.flats[r]).same_as(flat_rank(plans[r])) is None, r


def test_a_rank_that_breaks_the_line_is_found_by_bisection():
    """Vocabulary padding on the last ranks and kv heads replicated over TP ranks are not affine: more ranks are
    recorded until every segment is, and the predictions are still exact."""
    layout = Layout(tp=16)
    case = {"shard": 1, "vocab": 13 * 16 - 40, "num_kv": 4, "num_layers": 1, "num_experts": 0}
    plans = {r: synthetic_plan(layout, r, case)[0] for r in range(16)}
    recorded = []
    ext = extend_ranks(layout, range(16), lambda r: recorded.append(r) or flat_rank(plans[r]))
    assert ext.notes and len(recorded) > 3
    for r in range(16):
        assert sorted_rows(ext.flats[r]).same_as(flat_rank(plans[r])) is None, r


def test_line_refuses_what_is_not_affine():
    layout = Layout(tp=4)
    case = {"shard": 2, "vocab": 16, "num_kv": 8, "num_layers": 1, "num_experts": 0}
    flats = [flat_rank(synthetic_plan(layout, r, case)[0]) for r in range(4)]
    line = Line(flats[0], (0,), [(flats[3], (3,))])
    assert sorted_rows(line.at((1,))).same_as(flats[1]) is None
    odd = FlatRank(
        {k: v + 1 for k, v in flats[3].rows.items()},
        flats[3].ordered,
        flats[3].ordered_ints,
        flats[3].ordered_counts,
        flats[3].params,
        flats[3].param_ints,
        flats[3].fallbacks,
    )
    try:
        Line(flats[0], (0,), [(odd, (2,))])
    except NotAffine:
        pass
    else:
        raise AssertionError("an offset of 1 over a distance of 2 must not give a line")


def test_rank_classes_follow_the_layout():
    by_key = {c.key: c.coords for c in rank_classes(Layout(tp=2, dp=3, ep=True), range(6), num_experts=8)}
    assert by_key == {
        (("pp", 0), ("more experts", True)): {0: (0, 0), 1: (1, 0)},
        (("pp", 0), ("more experts", False)): {2: (0, 1), 3: (1, 1), 4: (0, 2), 5: (1, 2)},
    }
    without_ep = rank_classes(Layout(tp=2, dp=2), range(4))  # MoE layers span the DP ranks without EP too
    assert [c.coords for c in without_ep] == [{0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}]


@settings(max_examples=150, deadline=None)
@given(
    st.sets(
        st.tuples(st.integers(0, 5), st.integers(-1, 4), st.sampled_from([0, 1, 2, 3, 5, 8, 9, 12])),
        min_size=1,
        max_size=80,
    ),
    st.integers(1, 3),
)
def test_trie_from_rows_equals_build_trie(tuples, width):
    """The numpy trie builder (compile._make_groups on ~10^6 rows of an extended layout) makes build_trie's trie."""
    rows = sorted({t[:width] for t in tuples})
    shuffled = np.asarray(rows[::-1], dtype=np.int64)
    assert trie_from_rows(shuffled) == build_trie(rows)
