"""The object-per-write definitions the package's columnar paths are tested against (not shipped: the package's one
oracle is `shardplan.plan.interp.apply_reference`, what a write means).

- `instantiate(body, rank)`: a rank's `ir.RankPlan` built write by write from its templates, in the canonical order
  (`write_sort_key`); `rank_objects(plan_file, rank)` is that, bounds-checked (`check_group_bounds` per template),
  what `PlanFile.rank` (plan/file/rank.py, as columns) must equal write for write.
- `canonical(plan)`: what instantiating a directly recorded plan gives (the compiler's equality reference).
- `reference_layout(plans)`: the pack layout object by object, what `PackLayout.from_plans` (runtime/segments.py)
  must equal segment for segment.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from shardplan.errors import PlanError
from shardplan.plan import ir
from shardplan.plan.body import Group, PlanBody
from shardplan.plan.compile.simplify import compile_writes
from shardplan.plan.file.bounds import _lookup, _overlapping, check_bounds
from shardplan.plan.file.errors import PlanBoundsError, advice
from shardplan.plan.file.format import PlanFile
from shardplan.plan.names import group_of, group_order
from shardplan.plan.overlap import overlapping_writes
from shardplan.plan.template import pure_view_form, unflatten_write
from shardplan.runtime.pack import Segment, WriteRef, as_plans
from shardplan.runtime.tensors import align_up, broadcast_region, collapse


# ---- one rank of a plan body, write by write --------------------------------------------------------------
def write_sort_key(w: ir.Write):
    """The canonical order of a rank's free writes (plan/file/rank.py: canonical_order, on columns)."""
    # free writes never share a destination box (identical boxes overlap and go to `ordered`): this key is total
    return (w.param, w.dst.offset, w.dst.sizes, w.dst.strides)


def instantiate(body: PlanBody, rank: int, check=None) -> ir.RankPlan:
    """The rank's plan: templated writes in canonical order, then its ordered (overlapping) writes.
    `check(group, holes)` is called per group before its writes are built (the plan file's vectorised bounds check)."""
    if rank not in body.rank_params:
        raise KeyError(rank)
    writes: list[ir.Write] = []
    for g in body.groups:
        if check is not None:
            check(g, g.holes(rank))
        writes.extend(group_writes(g, rank))
    writes.sort(key=write_sort_key)
    writes.extend(body.ordered.get(rank, ()))
    return ir.RankPlan(
        rank=rank,
        params=tuple(body.meta(rank, n) for n in body.rank_params[rank]),
        writes=tuple(writes),
        fallbacks=tuple(body.fallbacks.get(rank, ())),
        not_needed=tuple(body.not_needed.get(rank, ())),
    )


def group_writes(group: Group, rank: int | None = None) -> list[ir.Write]:
    """The group's writes on `rank` (all ranks: None), one `ir.Write` per hole row."""
    holes = group.holes(rank)
    if len(holes) == 0:
        return []
    layout = pure_view_form(group.skeleton)
    if layout is not None:
        return pure_view_writes(layout, holes)
    return [unflatten_write(group.skeleton, row) for row in holes.tolist()]


def pure_view_writes(layout, holes: np.ndarray) -> list[ir.Write]:
    """Builds writes straight from hole rows (the generic Filler costs ~10x more; a non-EP Kimi-K2 rank has 70k).
    Names and regions repeat across layers and experts: they are built once and shared (records are immutable)."""
    ptext, kp, nd, stext, ks, ns = layout
    cache: dict = {}
    out = []
    Write, View, Region, Source = ir.Write, ir.View, ir.Region, ir.Source
    d0, d1 = kp, kp + 1 + 2 * nd
    s0 = d1 + ks
    s1 = s0 + 1 + 2 * ns
    for row in holes.tolist():
        pkey = ("p",) + tuple(row[:d0])
        pname = cache.get(pkey)
        if pname is None:
            pname = cache[pkey] = ptext.format(*row[:d0])
        dkey = tuple(row[d0:d1])
        dst = cache.get(dkey)
        if dst is None:
            dst = cache[dkey] = Region(row[d0], dkey[1 : 1 + nd], dkey[1 + nd :])
        skey = ("s",) + tuple(row[d1:s0])
        source = cache.get(skey)
        if source is None:
            source = cache[skey] = Source(stext.format(*row[d1:s0]))
        rkey = ("r",) + tuple(row[s0:s1])
        src = cache.get(rkey)
        if src is None:
            src = cache[rkey] = Region(row[s0], rkey[2 : 2 + ns], rkey[2 + ns :])
        out.append(Write(pname, dst, View(source, src)))
    return out


def canonical(plan: ir.RankPlan) -> ir.RankPlan:
    """What instantiate() returns for a directly recorded plan: the reference for equality tests."""
    free, kept = compile_writes(plan.writes)
    free = sorted(set(free), key=write_sort_key)
    kept = sorted(kept, key=lambda w: w.param)
    return ir.RankPlan(
        rank=plan.rank,
        params=tuple(sorted(plan.params, key=lambda p: p.name)),
        writes=tuple(free + kept),
        fallbacks=tuple(plan.fallbacks),
        not_needed=tuple(plan.not_needed),
    )


def rank_objects(plan_file: PlanFile, rank: int) -> ir.RankPlan:
    """The rank's plan with one `ir.Write` object per write (the pre-columnar path: tests and
    benchmarks compare `PlanFile.rank` against it), bounds-checked."""
    plan_file.check_rank(rank)
    rank_params = set(plan_file.body.rank_params[rank])

    def check(group, holes):
        check_group_bounds(group, holes, plan_file.body, rank_params, rank, plan_file.path)

    plan = instantiate(plan_file.body, rank, check)
    # writes of non-view templates and ordered writes were not covered by the vectorised check
    num_free = len(plan.writes) - len(plan_file.body.ordered.get(rank, ()))
    generic = [w for w in plan.writes[:num_free] if not ir.is_pure_view(w)] + list(plan.writes[num_free:])
    check_bounds(plan, plan_file.body.sources, plan_file.path, generic)
    return plan


def check_group_bounds(group, holes, body: PlanBody, rank_params: set, rank: int, path: str) -> None:
    """Vectorised check of a pure-view template's writes (others are checked write by write, in check_bounds)."""
    layout = pure_view_form(group.skeleton)
    if layout is None or len(holes) == 0:
        return
    ptext, kp, nd, stext, ks, ns = layout

    def check(first: int, ndim: int, name_cols: slice, text: str, lookup, what: str, dst: bool):
        names_ix, inverse = np.unique(holes[:, name_cols], axis=0, return_inverse=True)
        numels = []
        for row in names_ix.tolist():
            name = text.format(*row)
            meta = lookup(name)
            if meta is None:
                raise PlanBoundsError(
                    f"{path}: rank {rank}: {what} {name} is not declared for this rank. " + advice(path)
                )
            numels.append(meta.numel)
        numel = np.asarray(numels, dtype=np.float64)[inverse.reshape(-1)]
        # float64: exact for every in-bounds box (< 2^53), and overflow-free for hostile ones
        offset = holes[:, first].astype(np.float64)
        sizes = holes[:, first + 1 : first + 1 + ndim].astype(np.float64)
        strides = holes[:, first + 1 + ndim : first + 1 + 2 * ndim].astype(np.float64)
        negative = (offset < 0) | (sizes < 0).any(axis=1) | (strides < 0).any(axis=1)
        empty = (sizes == 0).any(axis=1)
        hi = offset + ((sizes - 1) * strides).sum(axis=1) + 1
        bad = negative | (~empty & (hi > numel))
        if dst:
            bad |= empty | _overlapping(sizes, strides)
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            name = text.format(*holes[i, name_cols].tolist())
            raise PlanBoundsError(
                f"{path}: rank {rank}: box (offset {int(holes[i, first])}, sizes "
                f"{sizes[i].astype(np.int64).tolist()}, strides "
                f"{strides[i].astype(np.int64).tolist()}) is negative, "
                f"{'empty, self-overlapping, ' if dst else ''}or lies outside {what} {name} "
                f"({int(numel[i])} elements). " + advice(path)
            )

    check(kp, nd, slice(0, kp), ptext, lambda n: body.meta(rank, n) if n in rank_params else None, "destination", True)
    first_src = kp + 1 + 2 * nd
    check(
        first_src + ks, ns, slice(first_src, first_src + ks), stext, lambda n: _lookup(body.sources, n), "source", False
    )


# ---- the pack layout, write by write ---------------------------------------------------------------------
def _layout_sort_key(w: ir.Write, dtype: str, rank_pos: int, index: int) -> tuple:
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
    return (
        group_order(group),
        rank_pos,
        kind,
        dtype,
        geometry,
        w.param,
        w.dst.sizes,
        w.dst.strides,
        w.dst.offset,
        tail,
        index,
    )


def _split_groups(
    groups: list[list], segments: list[Segment], max_bytes: int, keep_whole: set[str]
) -> tuple[list[list], list[Segment]]:
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
        if len(parts) == 1:  # only alignment padding was over the limit: nothing to split
            out.append([name, start, stop, first, last])
            continue
        parts[-1][2] = stop  # the group's trailing alignment padding stays with its last part
        for j in range(len(parts) - 1):
            parts[j][2] = parts[j + 1][1]  # each part runs up to the next (padding included)
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
        np.asarray([tuple(shape) + (1,) * (depth - len(shape)) for _, shape in writes], dtype=np.int64),
    )
    return {group_of(w.param) for (w, _), m in zip(writes, may.tolist()) if m}


def reference_layout(
    plans: ir.RankPlan | Sequence[ir.RankPlan], alignment: int = 256, max_group_bytes: int | None = None
) -> tuple[int, tuple[Segment, ...], list[list]]:
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
                raise PlanError(
                    f"rank {plan.rank}: write {index} targets {w.param!r}, which is not among the plan's params"
                )
            keyed.append((_layout_sort_key(w, dtypes[w.param], rank_pos, index), plan.rank, index, w, dtypes[w.param]))
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
