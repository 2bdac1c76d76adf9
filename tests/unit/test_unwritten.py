"""plan.unwritten: the elements of a rank's params no write of its plan covers (what the engine zero-fills), against
a mask built by writing every destination region of the plan; boxes drawn by hypothesis, contiguous and strided."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan.plan import ir
from shardplan.plan.unwritten import unwritten_ranges


@st.composite
def plans(draw):
    rows, cols = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    writes = []
    for _ in range(draw(st.integers(0, 6))):
        r0 = draw(st.integers(0, rows - 1))
        r1 = draw(st.integers(r0 + 1, rows))
        c0 = draw(st.integers(0, cols - 1))
        c1 = draw(st.integers(c0 + 1, cols))  # whole rows are contiguous runs, partial ones strided boxes
        dst = ir.Region(r0 * cols + c0, (r1 - r0, c1 - c0), (cols, 1))
        writes.append(ir.Write("w", dst, ir.View(ir.Source("x"), ir.full_region((r1 - r0, c1 - c0)))))
    return ir.RankPlan(0, (ir.TensorMeta("w", (rows, cols), "bfloat16"),), tuple(writes)), rows, cols


@settings(max_examples=300, deadline=None)
@given(plans())
def test_unwritten_ranges_are_the_complement_of_the_writes(drawn):
    plan, rows, cols = drawn
    written = torch.zeros(rows * cols, dtype=torch.bool)
    for w in plan.writes:
        written.as_strided(w.dst.sizes, w.dst.strides, w.dst.offset).fill_(True)
    got = torch.zeros(rows * cols, dtype=torch.bool)
    ranges = unwritten_ranges(plan).get("w", [])
    for lo, hi in ranges:
        got[lo:hi] = True
    assert torch.equal(got, ~written) if plan.writes else ranges == []
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))  # sorted, disjoint, not adjacent


def test_a_fully_written_param_is_not_listed():
    dst = ir.full_region((4, 3))
    plan = ir.RankPlan(0, (ir.TensorMeta("w", (4, 3), "float32"),), (ir.Write("w", dst, ir.View(ir.Source("x"), dst)),))
    assert unwritten_ranges(plan) == {}
