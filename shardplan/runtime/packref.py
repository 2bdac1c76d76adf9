"""The pack layout's reference definition, one Python object per write: what `PackLayout.from_plans` computed before
it went columnar (runtime/packcols.py). Tests compare the two on every shipped plan; bench/instantiate_bench.py times
both in one run."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from shardplan.plan import ir
from shardplan.plan.interp import PlanError
from shardplan.plan.names import group_of, group_order
from shardplan.plan.overlap import overlapping_writes
from shardplan.runtime.pack import Segment, WriteRef, as_plans
from shardplan.runtime.tensors import align_up, broadcast_region, collapse


def _write_sort_key(w: ir.Write, dtype: str, rank_pos: int, index: int) -> tuple:
    """Layout order: group, consumer rank, views before computed writes, then geometry so that writes a kernel can
    batch (same source geometry; destinations at a constant stride) sit next to each other at a constant stride."""
    group = group_of(w.param)
    if ir.is_pure_view(w):
        src = broadcast_region(w.src.region, w.dst.sizes) or w.src.region
        geometry = collapse(src.sizes, src.strides)
        tail = (w.src.leaf.name, w.src.region.offset)
        kind = 0
    else:
        geometry, tail, kind = ((), ()), ("", 0), 1
    return (group_order(group), rank_pos, kind, dtype, geometry, w.param, w.dst.sizes, w.dst.strides,
            w.dst.offset, tail, index)

def _split_groups(groups: list[list], segments: list[Segment], max_bytes: int,
                  keep_whole: set[str]) -> tuple[list[list], list[Segment]]:
    """Cut each [name, start, stop, first, last] group larger than max_bytes into parts at segment boundaries, except
    the groups in `keep_whole` (whose writes overlap: parts are applied one after the other, while overlapping writes
    must land in plan order, which only a whole group's apply keeps)."""
    out: list[list] = []
    for name, start, stop, first, last in groups:
        if stop - start <= max_bytes or name in keep_whole:
            out.append([name, start, stop, first, last])
            continue
        # ceil(bytes / max_bytes) parts of about equal size (each segment goes to the part its middle byte falls in):
        # a small tail part would leave the pipeline nothing to overlap the next pack with (a slot is refilled only
        # once the send two parts back has finished)
        num_parts = -(-(stop - start) // max_bytes)
        share = (stop - start) / num_parts
        parts: list[list] = []
        for i in range(first, last):
            seg = segments[i]
            index = min(num_parts - 1, int((seg.offset + seg.nbytes / 2 - start) // share))
            if not parts or index > parts[-1][5]:
                parts.append([f"{name}/{len(parts)}", seg.offset, seg.offset, i, i, index])
            parts[-1][2], parts[-1][4] = seg.offset + seg.nbytes, i + 1
        parts = [p[:5] for p in parts]
        if len(parts) == 1:   # only alignment padding was over the limit: nothing to split
            out.append([name, start, stop, first, last])
            continue
        parts[-1][2] = stop   # the group's trailing alignment padding stays with its last part
        for j in range(len(parts) - 1):
            parts[j][2] = parts[j + 1][1]   # each part runs up to the next (padding included)
        for part in parts:
            for i in range(part[3], part[4]):
                s = segments[i]
                segments[i] = Segment(s.offset, s.nbytes, s.dtype, s.shape, part[0], s.refs)
        out += parts
    return out, segments


def _overlapping_groups(writes: list[tuple[ir.Write, tuple]]) -> set[str]:
    """Groups in which two writes to one param name may share an element (overlap.overlapping_writes on each write's
    destination and its param's shape)."""
    if not writes:
        return set()
    names = sorted({w.param for w, _ in writes})
    ids = {n: i for i, n in enumerate(names)}
    width = max([len(w.dst.sizes) for w, _ in writes] + [1])
    depth = max([len(shape) for _, shape in writes] + [1])
    may = overlapping_writes(
        np.asarray([ids[w.param] for w, _ in writes], dtype=np.int64),
        np.asarray([w.dst.offset for w, _ in writes], dtype=np.int64),
        np.asarray([w.dst.sizes + (1,) * (width - len(w.dst.sizes)) for w, _ in writes], dtype=np.int64),
        np.asarray([w.dst.strides + (0,) * (width - len(w.dst.strides)) for w, _ in writes], dtype=np.int64),
        np.asarray([tuple(shape) + (1,) * (depth - len(shape)) for _, shape in writes], dtype=np.int64))
    return {group_of(w.param) for (w, _), m in zip(writes, may.tolist()) if m}


def reference_layout(plans: ir.RankPlan | Sequence[ir.RankPlan], alignment: int = 256,
                     max_group_bytes: int | None = None) -> tuple[int, tuple[Segment, ...], list[list]]:
    """(nbytes, segments, [group, start, stop, first, last] per group), object by object."""
    plans = as_plans(plans)
    if alignment <= 0 or alignment % 16:
        raise ValueError(f"alignment must be a positive multiple of 16 bytes, got {alignment}")
    keyed = []
    shapes = [{p.name: p.shape for p in plan.params} for plan in plans]
    for rank_pos, plan in enumerate(plans):
        dtypes = {p.name: p.dtype for p in plan.params}
        for index, w in enumerate(plan.writes):
            if w.param not in dtypes:
                raise PlanError(f"rank {plan.rank}: write {index} targets {w.param!r}, which is not among the "
                                f"plan's params")
            keyed.append((_write_sort_key(w, dtypes[w.param], rank_pos, index), plan.rank, index, w,
                          dtypes[w.param]))
    keyed.sort(key=lambda item: item[0])
    # dedup: identical bytes = same source view, same destination dtype and shape, same group
    slots: dict[tuple, list] = {}
    order: list[tuple] = []
    for _, rank, index, w, dtype in keyed:
        dedup_key = (group_of(w.param), w.src, dtype, w.dst.sizes)
        if dedup_key not in slots:
            slots[dedup_key] = []
            order.append(dedup_key)
        slots[dedup_key].append(WriteRef(rank, index, w.param, w.dst))
    segments, groups = [], []
    offset = 0
    for dedup_key in order:
        group, _, dtype, sizes = dedup_key
        if not groups or groups[-1][0] != group:
            offset = align_up(offset, alignment)
            groups.append([group, offset, offset, len(segments), len(segments)])
        nbytes = math.prod(sizes) * ir.itemsize(dtype)
        segments.append(Segment(offset, nbytes, dtype, tuple(sizes), group, tuple(slots[dedup_key])))
        offset = align_up(offset + nbytes, alignment)
        groups[-1][2] = offset
        groups[-1][4] = len(segments)
    if max_group_bytes is not None:
        if max_group_bytes <= 0:
            raise ValueError(f"max_group_bytes must be positive, got {max_group_bytes}")
        # groups with overlapping writes (of any of the plans' ranks) stay whole: parts are applied one after
        # the other, while overlapping writes must land in plan order, which only a whole group's apply keeps
        keep_whole = _overlapping_groups([(w, shapes[pos][w.param]) for (_, pos, *_), _, _, w, _ in keyed])
        groups, segments = _split_groups(groups, segments, max_group_bytes, keep_whole)
    return offset, tuple(segments), groups
