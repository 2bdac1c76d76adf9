"""The one overlap finder: which writes' destinations may touch the same elements of a param.

A write's destination is a strided region; its element extent [lo, hi) over-approximates it (two interleaved strided
writes may share an extent and no element). Every user of overlap is conservative in the same direction: the
compiler keeps overlapping writes in recording order, the pack layout keeps such a group whole, the applier orders
them, the sharded planner gives them to one trainer. For recorded writes extents are exact enough (the compiler
sweeps them, `overlapping_pairs`). The pure views the compiler makes of an upsampled block-FP8 scale
(plan/compile/simplify.py) interleave: a rank's column block next to another of the same expert, intersecting
extents, no shared element. So the pack layout, the applier and the sharded planner (`overlapping_writes`,
vectorised) compare writes whose extents meet as boxes of their param, and only those that share an element count as
overlapping.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from shardplan.plan import ir
from shardplan.plan.rowkeys import distinct_rows

K = TypeVar("K", bound=Hashable)


def overlapping_pairs(spans: Iterable[tuple[str, int, int, K]]) -> Iterator[tuple[K, K]]:
    """(key, key) for every two non-empty spans (param, lo, hi, key) of one param whose [lo, hi) intersect."""
    by_param: dict[str, list[tuple[int, int, K]]] = {}
    for param, lo, hi, key in spans:
        if hi > lo:
            by_param.setdefault(param, []).append((lo, hi, key))
    for items in by_param.values():
        items.sort(key=lambda item: (item[0], item[1]))
        active: list[tuple[int, int, K]] = []  # heap of (hi, order, key) still open at the current lo
        for order, (lo, hi, key) in enumerate(items):
            while active and active[0][0] <= lo:
                heapq.heappop(active)
            for _, _, other in active:
                yield other, key
            heapq.heappush(active, (hi, order, key))


def write_spans(writes: Sequence[ir.Write]) -> Iterator[tuple[str, int, int, int]]:
    """(param, lo, hi, write index) of each write's destination extent."""
    for i, w in enumerate(writes):
        lo, hi = w.dst.extent() if w.dst.numel else (0, 0)
        yield w.param, lo, hi, i


def overlapping_params(writes: Sequence[ir.Write]) -> set[str]:
    """Params that two of `writes` write overlapping extents of."""
    return {writes[a].param for a, _ in overlapping_pairs(write_spans(writes))}


def overlap_clusters(writes: Sequence[ir.Write]) -> list[list[int]]:
    """Indices of writes whose destinations overlap, transitively, in clusters of two or more (plan order)."""
    parent = list(range(len(writes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in overlapping_pairs(write_spans(writes)):
        parent[find(a)] = find(b)
    clusters: dict[int, list[int]] = {}
    for i in range(len(writes)):
        clusters.setdefault(find(i), []).append(i)
    return [c for c in clusters.values() if len(c) > 1]


def overlap_levels(spans: Iterable[tuple[str, int, int, int]]) -> dict[int, int]:
    """spans: (param, lo, hi, write index). write index -> level, such that a write comes after every earlier-in-plan
    write whose span overlaps it: writes of one level can be applied in any order (or batched)."""
    spans = list(spans)
    earlier: dict[int, list[int]] = {}
    for a, b in overlapping_pairs(spans):
        earlier.setdefault(max(a, b), []).append(min(a, b))
    levels: dict[int, int] = {}
    for index in sorted(s[3] for s in spans):
        levels[index] = 1 + max((levels[e] for e in earlier.get(index, ())), default=-1)
    return levels


# ---- the vectorised finder: extents, then boxes where extents meet ------------------------------------------------
def overlapping_writes(
    param: np.ndarray, offset: np.ndarray, sizes: np.ndarray, strides: np.ndarray, shapes: np.ndarray
) -> np.ndarray:
    """Per write (rows; `sizes`/`strides` padded with 1/0, `shapes` the param's shape as the write's plan declares
    it, padded with trailing 1s): whether its destination may share an element with another write of the same param
    id. Extents first: writes whose extents meet nobody's are clear. Where extents meet, the writes are compared as
    boxes of their param: the pure views the compiler makes of an upsampled scale (plan/compile/simplify.py) interleave
    in memory (a column block next to another: intersecting extents) and share no element. A run of meeting extents
    longer than MAX_BOX_RUN, a destination that is not a box, or params of different shapes count as overlapping."""
    n = len(param)
    out = np.zeros(n, dtype=bool)
    lo = offset.copy()
    hi = offset + 1
    for j in range(sizes.shape[1]):
        hi = hi + (sizes[:, j] - 1) * strides[:, j]
    live = np.flatnonzero((sizes > 0).all(axis=1)) if sizes.shape[1] else np.arange(n)
    if len(live) < 2:
        return out
    order = live[np.lexsort((hi[live], lo[live], param[live]))]
    # dense ranks of the bounds keep `param * span + bound` small: later params start above every earlier hi
    _, ranked = np.unique(np.concatenate([lo[order], hi[order]]), return_inverse=True)
    ranked = ranked.reshape(-1)
    span = len(ranked) + 1
    p = param[order]
    lo_r, hi_r = ranked[: len(order)] + p * span, ranked[len(order) :] + p * span
    reach = np.maximum.accumulate(hi_r)
    run = np.cumsum(np.concatenate([[True], lo_r[1:] >= reach[:-1]])) - 1  # runs of meeting extents
    counts = np.bincount(run)
    met = order[counts[run] > 1]
    if not len(met):
        return out
    box_lo, box_hi, known = _boxes(offset[met], sizes[met], strides[met], shapes[met])
    met_shapes = shapes[met]
    run_of = run[counts[run] > 1]
    starts = np.flatnonzero(np.concatenate([[True], run_of[1:] != run_of[:-1]]))
    lengths = counts[run_of[starts]]
    # runs of two (one upsampled scale's head and whole blocks: nearly all of them), vectorised
    a = starts[lengths == 2]
    b = a + 1
    apart = ((box_hi[a] <= box_lo[b]) | (box_hi[b] <= box_lo[a])).any(axis=1)
    clear = known[a] & known[b] & (met_shapes[a] == met_shapes[b]).all(axis=1) & apart
    out[met[a]] = ~clear
    out[met[b]] = ~clear
    for first, length in zip(starts[lengths > 2].tolist(), lengths[lengths > 2].tolist()):  # pairwise, in Python
        members = np.arange(first, first + length)
        if length > MAX_BOX_RUN or not known[members].all() or not (met_shapes[members] == met_shapes[first]).all():
            out[met[members]] = True
            continue
        lo_m, hi_m = box_lo[members], box_hi[members]  # [k, dims]
        clash = ~((hi_m[:, None, :] <= lo_m[None, :, :]) | (hi_m[None, :, :] <= lo_m[:, None, :])).any(axis=2)
        np.fill_diagonal(clash, False)
        out[met[members]] = clash.any(axis=1)
    return out


MAX_BOX_RUN = 16  # writes with meeting extents compared as boxes, pairwise (an upsampled scale: 2-3 pieces)


def _boxes(
    offset: np.ndarray, sizes: np.ndarray, strides: np.ndarray, shapes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: [lo, hi) per param dim of the destination as a box of its param, and whether it is one (dims of
    size > 1 walking param dims with step 1, a param dim possibly in row blocks: `_box_lengths`)."""
    num, dims = shapes.shape
    box_lo = np.zeros((num, dims), dtype=np.int64)
    box_hi = np.ones((num, dims), dtype=np.int64)
    known = np.zeros(num, dtype=bool)
    geometry = np.concatenate([sizes, strides, shapes], axis=1)
    first, inverse = distinct_rows(geometry)
    width = sizes.shape[1]
    for c, row in enumerate(geometry[first].tolist()):
        rows = np.flatnonzero(inverse == c)
        shape = row[2 * width :]
        lengths = _box_lengths(row[:width], row[width : 2 * width], shape)
        if lengths is None:
            continue
        cst = ir.contiguous_strides(shape)
        start = np.stack([(offset[rows] // st) % max(n, 1) for st, n in zip(cst, shape)], axis=1)
        box_lo[rows] = start
        box_hi[rows] = start + np.asarray(lengths, dtype=np.int64)
        known[rows] = (box_hi[rows] <= np.asarray(shape, dtype=np.int64)).all(axis=1) & (
            offset[rows] < max(1, int(np.prod(shape, dtype=np.int64)))
        )
    return box_lo, box_hi, known


def _box_lengths(sizes: list[int], strides: list[int], shape: list[int]) -> list[int] | None:
    """Length per param dim of a destination whose dims (of size > 1) each step inside one param dim, and those of one
    param dim chain into one run (the innermost at the dim's stride, each next one stepping over the last whole: a
    dim split in row blocks); None for any other destination."""
    cst = ir.contiguous_strides(shape)
    by_dim: dict[int, list[tuple[int, int]]] = {}
    for n, st in zip(sizes, strides):
        if n == 1:
            continue
        d = next(
            (
                d
                for d in range(len(shape))
                if shape[d] > 1 and cst[d] <= st and (d == 0 or st < cst[d - 1]) and st % cst[d] == 0
            ),
            None,
        )
        if d is None:
            return None
        by_dim.setdefault(d, []).append((st, n))
    lengths = [1] * len(shape)
    for d, dims in by_dim.items():
        expected = cst[d]
        for st, n in sorted(dims):
            if st != expected:
                return None
            expected = st * n
        lengths[d] = expected // cst[d]
    return lengths


def param_shapes(names: Sequence[str], metas) -> np.ndarray:
    """int64 [len(names) + 1, max ndim]: each param's shape padded with trailing 1s (a last row of 1s: the padding
    param id the columns use)."""
    shapes = [tuple(metas[n].shape) for n in names]
    width = max([len(s) for s in shapes] + [1])
    return np.asarray([s + (1,) * (width - len(s)) for s in shapes] + [(1,) * width], dtype=np.int64)
