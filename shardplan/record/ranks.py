"""Which ranks to record for a whole layout, and the prediction of the others (plan/compile/extend.py).

Rank classes come from the layout: a loader sees the TP rank, and with expert parallelism the EP rank (dp x tp ranks
of a pipeline stage, TP fastest) and how many experts it holds (vLLM gives the first `num_experts % ep_size` EP ranks
one more). So ranks are grouped by pipeline stage and, under EP, by expert count; within a group the coordinate u is
the rank within the stage's DP x TP ranks (vLLM's MoE layers span the DP ranks with or without EP: experts split or
sliced over DP x TP). With both TP > 1 and DP > 1, u = (TP rank, DP rank): experts follow DP rank x TP + TP rank,
the rest the TP rank, both affine in u.

One coordinate: the first two ranks of a class determine the line (their difference is the exact change per rank; they
must be neighbours, else the segment is halved), the last rank checks it; equal, every rank of the class is predicted. A
loader's offsets are products of the rank (affine), floor divisions of it (kv heads replicated over TP ranks: a
staircase, whose step between neighbours is 0 or a whole head, never what the far end needs) and boundaries (padding
rows on the last ranks, uneven experts: the far end is off the line unless two such breaks cancel there). Not equal, or
no line at all (other templates, row counts, indivisible offsets): split at the middle and do the same on both halves,
recording more ranks, at worst every one. Ranks that share a coordinate (DP replicas) are predicted from the first; the
class's last rank is recorded to check that, and if it differs every rank of the class is recorded. Two coordinates: the
first rank and its next along each axis determine the plane, the far corner checks it; otherwise one 1-D class per DP
replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from shardplan.plan.compile.extend import FlatRank, Line, NotAffine, Predicted, sorted_rows
from shardplan.plan.layout import Layout


@dataclass
class RankClass:
    key: tuple
    coords: dict[int, tuple[int, ...]] = field(default_factory=dict)  # rank -> u


def rank_classes(layout: Layout, ranks: Sequence[int], num_experts: int = 0) -> list[RankClass]:
    classes: dict[tuple, RankClass] = {}
    ep_size = layout.dp * layout.tp
    for rank in ranks:
        dp_rank, pp_rank, tp_rank = layout.coords(rank)
        key: tuple = (("pp", pp_rank),)
        # MoE layers span the DP ranks with or without EP (vLLM shards experts over dp x tp without EP too)
        ep_rank = dp_rank * layout.tp + tp_rank
        u: tuple[int, ...] = (tp_rank, dp_rank) if layout.tp > 1 and layout.dp > 1 else (ep_rank,)
        if layout.ep and num_experts and num_experts % ep_size:
            key += (("more experts", ep_rank < num_experts % ep_size),)
        classes.setdefault(key, RankClass(key)).coords[rank] = u
    return list(classes.values())


@dataclass
class Extension:
    flats: dict[int, FlatRank | Predicted]  # every rank asked for: recorded, or predicted (rows not made)
    recorded: list[int]  # the ranks actually recorded, in recording order
    notes: list[str]  # why extra ranks were recorded


def extend_ranks(
    layout: Layout, ranks: Sequence[int], record: Callable[[int], FlatRank], num_experts: int = 0
) -> Extension:
    """Record the ranks needed to determine and check each class's affine map; predict the rest."""
    out = Extension({}, [], [])
    recorded: dict[int, FlatRank] = {}

    def get(rank: int) -> FlatRank:
        if rank not in recorded:
            recorded[rank] = record(rank)
            out.recorded.append(rank)
        return recorded[rank]

    for cls in rank_classes(layout, ranks, num_experts):
        if len(next(iter(cls.coords.values()))) == 2 and _plane(cls, get, out):
            continue
        for part in _one_dimensional(cls):
            _bisect(part, get, out)
    return out


def _one_dimensional(cls: RankClass) -> list[RankClass]:
    """A class over (TP rank, DP rank) as one class per DP replica over the TP rank."""
    if len(next(iter(cls.coords.values()))) == 1:
        return [cls]
    parts: dict[int, RankClass] = {}
    for rank, (tp_rank, dp_rank) in cls.coords.items():
        parts.setdefault(dp_rank, RankClass(cls.key + (("dp", dp_rank),))).coords[rank] = (tp_rank,)
    return list(parts.values())


def _plane(cls: RankClass, get, out: Extension) -> bool:
    """EP with TP > 1 and DP > 1: experts follow the EP rank, the rest the TP rank; both are affine in (TP rank,
    DP rank). The first rank and its next along each axis determine the plane; the far corner checks it. False (and
    nothing predicted) if that fails."""
    by_u = {u: r for r, u in sorted(cls.coords.items(), reverse=True)}  # u -> its lowest rank
    u0 = min(by_u)
    u_t, u_d = (u0[0] + 1, u0[1]), (u0[0], u0[1] + 1)
    far = max(by_u)
    if u_t not in by_u or u_d not in by_u or far in (u0, u_t, u_d):
        return False
    try:
        plane = Line(get(by_u[u0]), u0, [(get(by_u[u_t]), u_t), (get(by_u[u_d]), u_d)])
        problem = sorted_rows(plane.at(far)).same_as(get(by_u[far]))
    except NotAffine as e:
        problem = str(e)
    if problem:
        out.notes.append(f"{_describe(cls.key)} not affine in (TP rank, DP rank): {problem}; one class per DP replica")
        return False
    for rank, u in cls.coords.items():
        out.flats[rank] = plane.predict(u)
    for rank in out.recorded:
        if rank in cls.coords:
            out.flats[rank] = get(rank)
    return True


def _bisect(cls: RankClass, get, out: Extension) -> None:
    by_u: dict[tuple, list[int]] = {}
    for rank, u in sorted(cls.coords.items()):
        by_u.setdefault(u, []).append(rank)
    us = sorted(by_u)
    first = {u: by_u[u][0] for u in us}
    predicted: dict[tuple, FlatRank | Predicted] = {}  # u -> the plan of first[u]
    segments = [(0, len(us) - 1)]
    while segments:
        lo, hi = segments.pop()
        if hi - lo <= 2:
            for i in range(lo, hi + 1):
                predicted[us[i]] = get(first[us[i]])
            continue
        if us[lo + 1][0] != us[lo][0] + 1:
            # not neighbours (a subset of ranks): their chord of a staircase can meet the far end with ranks between
            # off it (kv heads over TP 8 = 4 heads: TP ranks 0, 2, 4 on a line, 3 not); halve until they are
            mid = (lo + hi) // 2
            segments += [(lo, mid), (mid, hi)]
            continue
        # the first two determine the line (their difference is the slope per rank), the last checks it
        a, next_a, last = get(first[us[lo]]), get(first[us[lo + 1]]), get(first[us[hi]])
        try:
            line = Line(a, us[lo], [(next_a, us[lo + 1])])
            problem = sorted_rows(line.at(us[hi])).same_as(last)
        except NotAffine as e:
            problem = str(e)
        if problem is None:
            for i in range(lo, hi + 1):
                predicted[us[i]] = line.predict(us[i])
            continue
        out.notes.append(f"ranks {first[us[lo]]}..{first[us[hi]]} {_describe(cls.key)}: {problem}")
        mid = (lo + hi) // 2
        segments += [(lo, mid), (mid, hi)]
    replicas = [r for u in us for r in by_u[u][1:]]
    if replicas:
        last_replica = max(replicas)
        problem = get(last_replica).same_as(sorted_rows(predicted[cls.coords[last_replica]]))
        if problem:
            out.notes.append(f"rank {last_replica} is not a copy of rank {first[cls.coords[last_replica]]}: {problem}")
            for r in replicas:
                get(r)
    for rank, u in cls.coords.items():
        out.flats[rank] = predicted[u]
    for rank in out.recorded:
        if rank in cls.coords:
            out.flats[rank] = get(rank)


def _describe(key: tuple) -> str:
    return "(" + ", ".join(f"{k} {v}" for k, v in key) + ")"
