"""The segments of a pack layout: where each write's bytes sit in a buffer, computed for `PackLayout.from_plans`.

    layout_arrays(plans, alignment, max_group_bytes) -> what PackLayout holds, as arrays (pack.SegmentTable)
    segment := one packed blob: dtype, shape, byte offset, group, the writes (rank, index) it serves
    shared  := same group, same source view, same destination dtype and shape   # such writes share one segment

The definition is runtime/pack.py's, per write; here it runs without one Python object per write: per-write keys
are small integers (ordinals of names, dtypes, groups, geometries, each computed once per distinct value), sorted by
one `np.lexsort`, deduplicated, given aligned offsets and split into parts where a group is too large.
tests/unit/test_columns.py compares the result with the object path (tests/reference.py: `reference_layout`).

Replay and apply share the geometry helpers on columns (`geometry_keys`, `class_extents`, `check_class_extents`,
`region_tuples`); the box bounds rule itself lives in plan/file/bounds.py.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from shardplan.errors import PlanError
from shardplan.plan import ir
from shardplan.plan.columns import WriteColumns, columns_of
from shardplan.plan.file.bounds import check_extents
from shardplan.plan.names import group_of, group_order
from shardplan.plan.overlap import overlapping_writes, param_shapes
from shardplan.plan.rowkeys import Columns, distinct_rows, row_keys, stable_argsort
from shardplan.runtime.tensors import broadcast_region, collapse


def ordinals(values: list) -> tuple[np.ndarray, list]:
    """Rank of each value among the distinct values (Python ordering): (ordinal per value, sorted distinct)."""
    distinct = sorted(set(values))
    at = {v: i for i, v in enumerate(distinct)}
    return np.asarray([at[v] for v in values], dtype=np.int64), distinct


def region_tuples(cols: WriteColumns, side: str, rows: np.ndarray) -> list[tuple]:
    """(sizes, strides) tuples of the given rows (call on distinct rows only)."""
    ndim, sizes, strides = cols.geometry_rows(side, rows)
    return [
        (tuple(size[:k]), tuple(stride[:k])) for k, size, stride in zip(ndim.tolist(), sizes.tolist(), strides.tolist())
    ]


def geometry_keys(cols: WriteColumns) -> tuple[np.ndarray, list]:
    """Per write: an id of its distinct (source region geometry, destination sizes); and per id the
    (broadcast source region or None, (collapsed sizes, collapsed strides)) replay reads it with. Cached on cols."""
    got = cols._cache.get("geometry_keys")
    if got is not None:
        return got
    src_class, _ = cols.region_classes("src")
    dst_class, _ = cols.region_classes("dst")
    pair = np.where(cols.src < 0, -1, src_class * (int(dst_class.max(initial=0)) + 1) + dst_class)
    first, inverse = distinct_rows(pair[:, None])  # computed writes: one shared id (their geometry is unused)
    out = []
    for (src_sizes, src_strides), (dst_sizes, _) in zip(
        region_tuples(cols, "src", first), region_tuples(cols, "dst", first)
    ):
        region = ir.Region(0, src_sizes, src_strides)
        src = broadcast_region(region, dst_sizes)
        out.append((src, collapse(*((src or region).sizes, (src or region).strides))))
    cols._cache["geometry_keys"] = inverse, out
    return inverse, out


def shared_source_ids(all_cols: Sequence[WriteColumns]) -> list[np.ndarray]:
    """Source ids comparable across plans: each plan's own when they share one id table, else ids of the names."""
    if all(c.sources is all_cols[0].sources for c in all_cols):
        return [c.src for c in all_cols]
    names: dict[str, int] = {}
    out = []
    for c in all_cols:
        used = np.unique(c.src[c.src >= 0])
        mapped = np.asarray(
            [names.setdefault(c.sources.name(int(i)), len(names)) for i in used.tolist()], dtype=np.int64
        )
        ids = np.full(len(c.src), -1, dtype=np.int64)
        if len(used):
            ids[c.src >= 0] = mapped[np.searchsorted(used, c.src[c.src >= 0])]
        out.append(ids)
    return out


def layout_arrays(plans: Sequence[ir.RankPlan], alignment: int, max_group_bytes: int | None) -> dict:
    """Everything `PackLayout` holds, as arrays: see `pack.SegmentTable` for the fields."""
    all_cols = [columns_of(p) for p in plans]
    param_gid: dict[str, int] = {}
    per_plan = []
    for rank_pos, (plan, cols) in enumerate(zip(plans, all_cols)):
        if (cols.param >= len(plan.params)).any():
            index = int(np.nonzero(cols.param >= len(plan.params))[0][0])
            raise PlanError(
                f"rank {plan.rank}: write {index} targets {cols.param_names[cols.param[index]]!r}, which "
                f"is not among the plan's params"
            )
        if any(p.name != n for p, n in zip(plan.params, cols.param_names)):
            raise PlanError(f"rank {plan.rank}: the columns' params are not the plan's")
        gids = np.asarray([param_gid.setdefault(p.name, len(param_gid)) for p in plan.params] + [0], dtype=np.int64)
        per_plan.append(gids)
    param_names = list(param_gid)
    # per global param: name ordinal, group ordinal, dtype ordinal (Python per param, not per write)
    name_ord, _ = ordinals(param_names)
    groups = [group_cached(n) for n in param_names]
    group_keys = [_group_order(g) for g in groups]
    group_ord, group_sorted = ordinals(list(zip(group_keys, groups)))
    group_names = [g for _, g in group_sorted]
    # a param's dtype is the plan's (two ranks' plans may disagree: different bytes)
    dtype_names = sorted({p.dtype for plan in plans for p in plan.params})
    dtype_at = {d: i for i, d in enumerate(dtype_names)}
    plan_dtypes = [np.asarray([dtype_at[p.dtype] for p in plan.params] + [0], dtype=np.int64) for plan in plans]
    src_ids = shared_source_ids(all_cols)

    parts = {
        k: []
        for k in (
            "rank_pos",
            "dtype",
            "rank",
            "index",
            "param",
            "kind",
            "geometry",
            "dsizes",
            "dst_offset",
            "src",
            "src_offset",
            "srcgeo",
        )
    }
    geometry_tables, dst_tables, src_tables, computed_views = [], [], [], {}
    for rank_pos, (plan, cols) in enumerate(zip(plans, all_cols)):
        n = len(cols)
        gid = per_plan[rank_pos][cols.param]
        geo_id, geo_table = geometry_keys(cols)
        geometry_tables.append(geo_table)
        dst_id, first = cols.region_classes("dst")
        dst_tables.append(region_tuples(cols, "dst", first))
        src_geo, sfirst = cols.region_classes("src")
        src_tables.append(region_tuples(cols, "src", sfirst))
        src = src_ids[rank_pos].copy()
        for i, w in cols.computed.items():  # computed writes: identical bytes only for equal source expressions
            src[i] = -2 - computed_views.setdefault(w.src, len(computed_views))
        for key, value in (
            ("rank_pos", np.full(n, rank_pos)),
            ("dtype", plan_dtypes[rank_pos][cols.param]),
            ("rank", np.full(n, plan.rank)),
            ("index", np.arange(n)),
            ("param", gid),
            ("kind", (cols.src < 0).astype(np.int64)),
            ("geometry", geo_id + _LOCAL * rank_pos),
            ("dsizes", dst_id + _LOCAL * rank_pos),
            ("dst_offset", cols.dst_offset),
            ("src", src),
            ("src_offset", cols.src_offset),
            ("srcgeo", src_geo + _LOCAL * rank_pos),
        ):
            parts[key].append(np.asarray(value, dtype=np.int64))
    w = {
        k: (v[0] if len(v) == 1 else np.concatenate(v) if v else np.zeros(0, dtype=np.int64)) for k, v in parts.items()
    }
    # tuples -> global ordinals (the sort compares tuples as Python does)
    dsz_ord = _global_ordinals(w["dsizes"], [[d[0] for d in t] for t in dst_tables])
    src_geo = _global_ordinals(w["srcgeo"], src_tables)
    gp = w["param"]
    key = (
        _one_plan_key(all_cols[0], group_ord, name_ord, plan_dtypes[0], geometry_tables[0], dst_tables[0])
        if (len(plans) == 1 and len(gp))
        else None
    )
    if key is not None:
        packed = prefix = [key]
    else:
        geo_ord = _global_ordinals(w["geometry"], [[g[1] for g in t] for t in geometry_tables], w["kind"])
        dst_ord = _global_ordinals(w["dsizes"], [[d[1] for d in t] for t in dst_tables])
        prefix = [group_ord[gp], w["rank_pos"], w["kind"], w["dtype"], geo_ord, name_ord[gp], dsz_ord, dst_ord]
        packed = row_keys(Columns(prefix, len(gp))) if len(gp) else None  # mixed radix keeps lexicographic order
        if packed is not None:
            prefix = [packed[0]]
    offset_lo = int(w["dst_offset"].min()) if len(gp) else 0
    offset_span = int(w["dst_offset"].max()) - offset_lo + 1 if len(gp) else 1
    if packed is not None and (int(packed[0].max()) + 1) * offset_span < 1 << 62:  # one key: one stable sort
        order = stable_argsort(packed[0] * offset_span + (w["dst_offset"] - offset_lo))
    else:
        order = np.lexsort([w["dst_offset"]] + prefix[::-1])  # stable: ties keep plan order (the index key)
    order = _break_ties(order, w, prefix + [w["dst_offset"]], all_cols)
    one = len(plans) == 1  # one plan: rank and position are constants, the write index is the order
    w = {
        k: (w[k][: len(order)] if one and k in ("rank_pos", "rank") else order if one and k == "index" else w[k][order])
        for k in ("rank_pos", "dtype", "rank", "index", "param", "src", "src_offset")
    }
    dsz_ord = dsz_ord[order]
    gp = w["param"]
    # dedup: identical bytes = same source view, same destination dtype and shape, same group; only writes that share
    # their source tensor (or computed view) with another can be one (a rank reads most tensors once): the key rows
    # are numbered among those alone
    src = w["src"]
    first_of = np.arange(len(gp), dtype=np.int64)  # the first write (layout order) of each write's bytes
    if len(gp):
        shifted = src - int(src.min())
        shared = np.flatnonzero(np.bincount(shifted)[shifted] > 1)
    else:
        shared = first_of
    if len(shared):
        key = Columns(
            [a[shared] for a in (group_ord[gp], src, w["src_offset"], src_geo[order], w["dtype"], dsz_ord)], len(shared)
        )
        first, inverse = distinct_rows(key)
        first_of[shared] = shared[first[inverse]]
    is_first = first_of == np.arange(len(gp))
    num_segments = int(is_first.sum())
    one_per_write = num_segments == len(gp)
    if one_per_write:

        def by_seg(a):
            return a

        ref_start = np.arange(num_segments + 1, dtype=np.int64)
        rep = slice(None)
    else:
        seg = (np.cumsum(is_first) - 1)[first_of]  # segments numbered in layout order of their first write
        refs = stable_argsort(seg)  # refs of a segment in layout order

        def by_seg(a):
            return a[refs]

        ref_start = np.concatenate([[0], np.cumsum(np.bincount(seg, minlength=num_segments))]).astype(np.int64)
        rep = np.flatnonzero(is_first)  # each segment's first write (layout order)
    # per ref: its destination region; per segment: dtype, shape (its first ref's destination sizes), group, bytes,
    # offset (a segment's first ref is its first write in layout order: the refs' order is stable)
    ref_dst = _gather_dst(all_cols, by_seg(w["rank_pos"]), by_seg(w["index"]))
    seg_dtype = w["dtype"][rep]
    if one_per_write:
        seg_ndim, seg_shape = ref_dst["ndim"], ref_dst["sizes"]
    else:
        seg_ndim, seg_shape = ref_dst["ndim"][ref_start[:-1]], np.take(ref_dst["sizes"], ref_start[:-1], axis=0)
    numel = np.ones(num_segments, dtype=np.int64)
    for j in range(seg_shape.shape[1]):  # dims past ndim count 1
        numel *= np.where(seg_ndim > j, seg_shape[:, j], 1)
    itemsizes = np.asarray([ir.itemsize(d) for d in dtype_names], dtype=np.int64)
    nbytes = numel * itemsizes[seg_dtype] if num_segments else np.zeros(0, dtype=np.int64)
    padded = (nbytes + alignment - 1) // alignment * alignment
    offset = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64) if num_segments else padded
    total = int(padded.sum())
    seg_group = group_ord[gp[rep]]
    out = {
        "offset": offset,
        "nbytes": nbytes,
        "dtype": seg_dtype,
        "dtypes": tuple(dtype_names),
        "shape_ndim": seg_ndim,
        "shape": seg_shape,
        "group": seg_group,
        "group_names": tuple(group_names),
        "ref_start": ref_start,
        "ref_rank": by_seg(w["rank"]),
        "ref_index": by_seg(w["index"]),
        "ref_param": by_seg(gp),
        "param_names": tuple(param_names),
        "ref_dst_offset": ref_dst["offset"],
        "ref_dst_ndim": ref_dst["ndim"],
        "ref_dst_sizes": ref_dst["sizes"],
        "ref_dst_strides": ref_dst["strides"],
        "nbytes_total": total,
    }
    spans = _group_spans(seg_group, offset, total)
    if max_group_bytes is not None:
        if max_group_bytes <= 0:
            raise ValueError(f"max_group_bytes must be positive, got {max_group_bytes}")
        keep_whole = _overlapping_groups(
            gp,
            _gather_dst(all_cols, w["rank_pos"], w["index"]),
            _gather_shapes(plans, all_cols, w["rank_pos"], w["index"]),
            group_ord,
            group_names,
        )
        spans, out["group"], out["group_names"] = _split(spans, out, max_group_bytes, keep_whole)
    out["spans"] = spans
    return out


def _one_plan_key(
    cols: WriteColumns, group_ord, name_ord, param_dtypes, geometry_table, dst_table
) -> np.ndarray | None:
    """One plan's sort prefix (group, kind, dtype, geometry, name, destination sizes, destination strides; the rank
    position is constant) as one mixed-radix key per write, summed from a per-param, a per-geometry and a
    per-destination-class table: three gathers instead of a pass per key. None when the radix needs over 62 bits."""
    geo_id, _ = geometry_keys(cols)
    dst_id, _ = cols.region_classes("dst")
    geo, _ = ordinals([g[1] for g in geometry_table])
    kind = np.zeros(len(geo), dtype=np.int64)
    kind[geo_id[cols.src < 0]] = 1  # computed writes have geometry ids of their own
    geo = np.where(kind > 0, 0, geo)  # computed writes: geometry ((), ()) in the reference key, after `kind`
    dsz, _ = ordinals([d[0] for d in dst_table])
    dst, _ = ordinals([d[1] for d in dst_table])
    num_params = len(name_ord)
    tables = {
        "param": np.zeros(num_params, dtype=np.int64),
        "geo": np.zeros(len(geo), dtype=np.int64),
        "dst": np.zeros(len(dsz), dtype=np.int64),
    }
    digits = [
        ("param", group_ord),
        ("geo", kind),
        ("param", param_dtypes[:num_params]),
        ("geo", geo),
        ("param", name_ord),
        ("dst", dsz),
        ("dst", dst),
    ]
    mult = 1
    for part, values in reversed(digits):  # the last key varies fastest
        tables[part] += values * mult
        mult *= int(values.max(initial=0)) + 1
        if mult >= 1 << 62:
            return None
    return tables["param"][cols.param] + tables["geo"][geo_id] + tables["dst"][dst_id]


_GROUPS: dict[str, str] = {}
_GROUP_ORDERS: dict[str, tuple] = {}


def group_cached(name: str) -> str:
    """group_of, remembered per name (a layout asks it for every param of every plan)."""
    got = _GROUPS.get(name)
    if got is None:
        if len(_GROUPS) > 1 << 18:
            _GROUPS.clear()
        got = _GROUPS[name] = group_of(name)
    return got


def _group_order(group: str) -> tuple:
    got = _GROUP_ORDERS.get(group)
    if got is None:
        got = _GROUP_ORDERS[group] = group_order(group)
    return got


_LOCAL = 1 << 21  # > plancheck.MAX_WRITES_PER_RANK: local ids of plan `pos` are pos * _LOCAL + id


def _global_ordinals(local_ids: np.ndarray, tables: list[list], kind: np.ndarray | None = None) -> np.ndarray:
    """local_ids encode (plan position * 1e6 + id in that plan's table): the rank of each one's tuple among all."""
    flat, keys = [], []
    for pos, table in enumerate(tables):
        for j, value in enumerate(table):
            flat.append(value)
            keys.append(pos * _LOCAL + j)
    if not keys:
        return np.zeros(len(local_ids), dtype=np.int64)
    ords, _ = ordinals(flat)
    if len(tables) == 1:  # one plan: the local id is the position
        out = ords[local_ids]
    else:
        out = ords[np.searchsorted(np.asarray(keys, dtype=np.int64), local_ids)]
    if kind is not None:
        out = np.where(kind > 0, 0, out)  # computed writes: geometry ((), ()) in the reference key, after `kind`
    return out


def _break_ties(order, w, prefix_keys, all_cols) -> np.ndarray:
    """Writes equal in every key before the tail (source name, source offset) are ordered by it, as in the
    reference key: only overlapping writes to one box of one param can tie there (rare), so this is Python."""
    if len(order) < 2:
        return order
    same = np.ones(len(order) - 1, dtype=bool)
    for k in prefix_keys:
        ks = k[order]
        same &= ks[1:] == ks[:-1]
    if not same.any():
        return order
    order = order.copy()
    starts = np.nonzero(same & ~np.concatenate([[False], same[:-1]]))[0]
    for start in starts.tolist():
        stop = start + 1
        while stop < len(same) and same[stop]:
            stop += 1
        run = order[start : stop + 1].tolist()

        def tail(j):
            cols = all_cols[int(w["rank_pos"][j])]
            index = int(w["index"][j])
            if cols.src[index] < 0:
                return ("", 0, index)
            return (cols.source_name(index), int(cols.src_offset[index]), index)

        order[start : stop + 1] = sorted(run, key=tail)
    return order


def _gather_dst(all_cols, rank_pos, index) -> dict:
    width = max(c.geometry_width("dst") for c in all_cols) if all_cols else 1
    if len(all_cols) == 1 and all_cols[0].geometry_width("dst") == width:  # one plan: plain gathers
        cols = all_cols[0]
        ndim, sizes, strides = cols.geometry_rows("dst", index)
        return {"offset": cols.dst_offset[index], "ndim": ndim, "sizes": sizes, "strides": strides}
    n = len(index)
    out = {
        "offset": np.empty(n, dtype=np.int64),
        "ndim": np.empty(n, dtype=np.int64),
        "sizes": np.ones((n, width), dtype=np.int64),
        "strides": np.zeros((n, width), dtype=np.int64),
    }
    for pos, cols in enumerate(all_cols):
        mask = rank_pos == pos
        rows = index[mask]
        ndim, sizes, strides = cols.geometry_rows("dst", rows)
        out["offset"][mask] = cols.dst_offset[rows]
        out["ndim"][mask] = ndim
        out["sizes"][mask, : sizes.shape[1]] = sizes
        out["strides"][mask, : strides.shape[1]] = strides
    return out


def _gather_shapes(plans, all_cols, rank_pos, index) -> np.ndarray:
    """Per write: its param's shape as its plan declares it (padded with trailing 1s)."""
    tables = [param_shapes(c.param_names, {p.name: p for p in plan.params}) for plan, c in zip(plans, all_cols)]
    width = max([t.shape[1] for t in tables] + [1])
    out = np.ones((len(index), width), dtype=np.int64)
    for pos, (cols, table) in enumerate(zip(all_cols, tables)):
        mask = rank_pos == pos
        out[mask, : table.shape[1]] = table[cols.param[index[mask]]]
    return out


def _group_spans(seg_group: np.ndarray, offset: np.ndarray, total: int) -> list[list]:
    """[group ordinal, start, stop, first, last] per run of segments of one group."""
    if len(seg_group) == 0:
        return []
    firsts = np.nonzero(np.concatenate([[True], seg_group[1:] != seg_group[:-1]]))[0].tolist()
    spans = []
    for j, first in enumerate(firsts):
        last = firsts[j + 1] if j + 1 < len(firsts) else len(seg_group)
        stop = int(offset[last]) if last < len(seg_group) else total
        spans.append([int(seg_group[first]), int(offset[first]), stop, first, last])
    return spans


def extents(offset: np.ndarray, sizes: np.ndarray, strides: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi) element extent per row (padded dims have size 1: no reach); (offset, offset) when empty. Column by
    column (plan/rowkeys.py says why)."""
    lo, hi = offset.copy(), offset + 1
    empty = np.zeros(len(offset), dtype=bool)
    for j in range(sizes.shape[1]):
        reach = (sizes[:, j] - 1) * strides[:, j]
        lo += np.minimum(reach, 0)
        hi += np.maximum(reach, 0)
        empty |= sizes[:, j] == 0
    return np.where(empty, offset, lo), np.where(empty, offset, hi)


def class_extents(cols: WriteColumns, side: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, empty) of the `side` regions of the given writes, as `extents` gives them, computed once per
    geometry class (a template's writes share one) and gathered."""
    classes, first = cols.region_classes(side)
    _, sizes, strides = cols.geometry_rows(side, first)
    c_lo, c_hi = extents(np.zeros(len(first), dtype=np.int64), sizes, strides)
    c_empty = (sizes == 0).any(axis=1)
    klass = classes[rows]
    offset = getattr(cols, f"{side}_offset")[rows]
    empty = c_empty[klass]
    return np.where(empty, offset, offset + c_lo[klass]), np.where(empty, offset, offset + c_hi[klass]), empty


def check_class_extents(cols: WriteColumns, side: str, rows: np.ndarray, numel: np.ndarray, message) -> None:
    """file/bounds.py's `check_extents` on the `side` regions of the given writes, by their geometry classes."""
    classes, first = cols.region_classes(side)
    _, sizes, strides = cols.geometry_rows(side, first)
    check_extents(getattr(cols, f"{side}_offset")[rows], classes[rows], sizes, strides, numel, message)


def _overlapping_groups(gp, cols_dst, shapes, group_ord, group_names) -> set[str]:
    """Groups in which two writes (of any of the plans' ranks) to one param name may share an element
    (overlap.overlapping_writes: extents, then boxes of the param where extents meet)."""
    may = overlapping_writes(gp, cols_dst["offset"], cols_dst["sizes"], cols_dst["strides"], shapes)
    return {group_names[group_ord[p]] for p in np.unique(gp[may]).tolist()}


def _split(spans, out, max_bytes, keep_whole) -> tuple[list, np.ndarray, tuple]:
    """pack._split_groups on arrays: a group over max_bytes becomes parts "<group>/0", "<group>/1", ... of about
    equal size, each segment going to the part its middle byte falls in."""
    names = list(out["group_names"])
    seg_group = out["group"].copy()
    offset, nbytes = out["offset"], out["nbytes"]
    new_spans = []
    for gid, start, stop, first, last in spans:
        name = names[gid]
        if stop - start <= max_bytes or name in keep_whole:
            new_spans.append([gid, start, stop, first, last])
            continue
        num_parts = -(-(stop - start) // max_bytes)
        share = (stop - start) / num_parts
        mids = offset[first:last] + nbytes[first:last] / 2 - start
        index = np.minimum(num_parts - 1, np.floor_divide(mids, share).astype(np.int64))
        flags = np.concatenate([[True], index[1:] > index[:-1]])
        cuts = np.nonzero(flags)[0]
        if len(cuts) == 1:  # only alignment padding was over the limit: nothing to split
            new_spans.append([gid, start, stop, first, last])
            continue
        pid = len(names)
        names += [f"{name}/{p}" for p in range(len(cuts))]
        seg_group[first:last] = pid + np.cumsum(flags) - 1
        firsts = first + cuts
        starts = offset[firsts]
        # each part runs up to the next (padding included); the group's trailing padding stays with its last part
        stops = np.append(starts[1:], stop)
        lasts = np.append(firsts[1:], last)
        parts = [
            [pid + p, a, b, f, e]
            for p, (a, b, f, e) in enumerate(zip(starts.tolist(), stops.tolist(), firsts.tolist(), lasts.tolist()))
        ]
        new_spans += parts
    return new_spans, seg_group, tuple(names)
