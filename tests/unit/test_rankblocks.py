"""plan/compile/rankblocks.py templates rank classes as blocks (rows = base + offsets @ slopes) without materialising
every rank's rows; the groups must be exactly those `compile._make_groups` makes of the materialised rows. Random blocks
reach every path: exact fits, splits by a hole that does or does not move with the rank, variables shared within a
rank (one source written twice, or two predicted rows that meet), no holes, variables that move alike or not."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardplan.plan.compile.compiler import _make_groups
from shardplan.plan.compile.rankblocks import groups_of_blocks, line_block, literal, shift_trie
from shardplan.plan.template import trie_from_rows


@st.composite
def blocks_and_rows(draw):
    num_vars, num_holes = draw(st.integers(1, 3)), draw(st.integers(0, 3))
    num_coeffs = num_holes * (num_vars + 2)
    coeffs = np.asarray(
        draw(st.lists(st.integers(-2, 2), min_size=num_coeffs, max_size=num_coeffs)), dtype=np.int64
    ).reshape(num_holes, num_vars + 2)
    var_range = draw(st.sampled_from([2, 4, 50]))  # small: rows of a rank share their variables
    noise = draw(st.sampled_from(["none", "fixed", "moving"]))  # holes off the affine map: splits

    def int_array(shape, lo, hi):
        size = int(np.prod(shape))
        return np.asarray(draw(st.lists(st.integers(lo, hi), min_size=size, max_size=size)), dtype=np.int64).reshape(
            shape
        )

    def holes_of(rank, var_rows):  # the affine part: c0 + c_rank * rank + C @ vars
        return coeffs[:, 0] + coeffs[:, 1] * rank + var_rows @ coeffs[:, 2:].T

    blocks, materialised = [], []
    for b in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 6))
        base_vars = int_array((n, num_vars), 0, var_range - 1)
        if draw(st.booleans()):  # a recorded rank
            rank = 1000 * b
            rows = np.concatenate([base_vars, holes_of(rank, base_vars).reshape(n, num_holes)], axis=1)
            if noise != "none" and num_holes:
                rows[:, num_vars] += int_array((n,), 0, 1)
            rows = np.unique(rows, axis=0)
            blocks.append(literal(rank, rows, num_vars))
            materialised.append((rank, rows))
            continue
        num_axes = draw(st.integers(1, 2))
        per_axis = np.asarray([draw(st.integers(1, 3)), draw(st.integers(13, 20))][:num_axes])  # distinct ranks
        points = sorted(draw(st.sets(st.tuples(st.integers(0, 4), st.integers(0, 2)), min_size=1, max_size=8)))
        offsets = np.asarray([p[:num_axes] for p in points], dtype=np.int64)
        offsets = np.unique(offsets, axis=0)
        ranks = 1000 * b + 100 + offsets @ per_axis
        kind = draw(st.sampled_from(["still", "alike", "any"]))
        if kind == "still":
            var_slopes = np.zeros((num_axes, n, num_vars), dtype=np.int64)
        elif kind == "alike":
            var_slopes = np.repeat(int_array((num_axes, 1, num_vars), -2, 2), n, axis=1)
        else:
            var_slopes = int_array((num_axes, n, num_vars), -2, 2)
        base_rank = 1000 * b + 100
        base_holes = holes_of(base_rank, base_vars).reshape(n, num_holes)
        hole_slopes = coeffs[:, 1][None, None, :] * per_axis[:, None, None] + np.einsum(
            "anv,hv->anh", var_slopes, coeffs[:, 2:]
        )
        if noise == "fixed" and num_holes:
            base_holes[:, 0] += int_array((n,), 0, 1)
        if noise == "moving" and num_holes:
            hole_slopes[:, :, -1] += int_array((num_axes, n), 0, 1)
        base = np.concatenate([base_vars, base_holes], axis=1)
        slopes = np.concatenate([var_slopes, hole_slopes], axis=2)
        blocks.extend(line_block(ranks.tolist(), offsets.tolist(), base, slopes, num_vars))
        for rank, k in zip(ranks.tolist(), offsets):
            materialised.append((rank, base + np.tensordot(k, slopes, axes=1)))
    return blocks, materialised, num_vars


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks_and_rows())
def test_groups_of_blocks_are_make_groups_of_the_rows(case):
    blocks, materialised, num_vars = case
    rows = np.unique(
        np.concatenate([np.concatenate([np.full((len(r), 1), rank), r], axis=1) for rank, r in materialised]), axis=0
    )  # compile dedupes per rank
    want, got = [], []
    _make_groups("S", rows[:, : num_vars + 1], rows[:, num_vars + 1 :], want)
    groups_of_blocks("S", blocks, num_vars, got)
    assert [(g.coeffs.tolist(), g.index, g.num_vars) for g in got] == [
        (g.coeffs.tolist(), g.index, g.num_vars) for g in want
    ]


@settings(max_examples=100, deadline=None)
@given(
    st.sets(
        st.tuples(st.integers(0, 6), st.integers(-2, 4), st.sampled_from([0, 1, 3, 4, 5, 9])), min_size=1, max_size=40
    ),
    st.tuples(st.integers(-5, 5), st.integers(-5, 5), st.integers(-5, 5)),
)
def test_shift_trie_is_the_trie_of_the_moved_rows(tuples, move):
    rows = np.asarray(sorted(tuples), dtype=np.int64)
    assert shift_trie(trie_from_rows(rows), list(move)) == trie_from_rows(rows + np.asarray(move))
