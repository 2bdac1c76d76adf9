"""The one overlap finder: which writes' destinations may touch the same elements of a param.

A write's destination is a strided region; its element extent [lo, hi) over-approximates it (two interleaved strided
writes may share an extent and no element). Every user of overlap is conservative in the same direction: the
compiler keeps overlapping writes in recording order, the pack layout keeps such a group whole, the applier orders
them, the sharded planner gives them to one trainer. So extents are exact enough, and one sweep serves all four.
"""
from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Iterator, Sequence, TypeVar

from shardplan.plan import ir

K = TypeVar("K", bound=Hashable)


def overlapping_pairs(spans: Iterable[tuple[str, int, int, K]]) -> Iterator[tuple[K, K]]:
    """(key, key) for every two non-empty spans (param, lo, hi, key) of one param whose [lo, hi) intersect."""
    by_param: dict[str, list[tuple[int, int, K]]] = {}
    for param, lo, hi, key in spans:
        if hi > lo:
            by_param.setdefault(param, []).append((lo, hi, key))
    for items in by_param.values():
        items.sort(key=lambda item: (item[0], item[1]))
        active: list[tuple[int, int, K]] = []   # heap of (hi, order, key) still open at the current lo
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
