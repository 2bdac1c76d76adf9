"""Applier's plan-only work on columns: matching a layout's refs to a consumer rank's writes (every check vectorised)
and ordering the placed writes into steps of strided runs (runtime/apply.py uses these)."""
from __future__ import annotations

import numpy as np

from shardplan.plan import ir
from shardplan.plan.columns import WriteColumns
from shardplan.plan.interp import PlanError
from shardplan.plan.names import base_group
from shardplan.plan.overlap import overlap_levels, overlapping_writes, param_shapes
from shardplan.runtime.packcols import class_extents, group_cached, region_tuples
from shardplan.runtime.tensors import collapse


class Placement:
    """This rank's writes placed in the layout, as columns: write index, buffer offset, param id (in the plan's
    params), destination offset, collapsed geometry id (`geometry[id]` = (sizes, strides)), dtype id (in `dtypes`) per row;
    only segments with bytes. `seen`: bool per write, True where the layout has a ref for it."""

    def __init__(self, write, offset, param, dst_offset, geometry_id, geometry, dtype_id, dtypes, seen):
        self.write, self.offset, self.param, self.dst_offset = write, offset, param, dst_offset
        self.geometry_id, self.geometry, self.dtype_id, self.dtypes, self.seen = (geometry_id, geometry, dtype_id,
                                                                                  dtypes, seen)


def place(plan: ir.RankPlan, cols: WriteColumns, layout, mismatch) -> Placement:
    """The checks of the pre-columnar `Applier._place` (same errors), on arrays. `mismatch`: the error class for a
    layout that does not describe this plan."""
    table = layout.segments
    rank = plan.rank
    if rank not in layout.ranks:
        raise mismatch(f"the layout was computed for consumer ranks {list(layout.ranks)}, not rank {rank}")
    one_ref_each = len(table.ref_rank) == len(table) and (np.diff(table.ref_start) == 1).all()
    if one_ref_each and (table.ref_rank == rank).all():   # this rank's own layout (the usual): no gathers
        seg, index = np.arange(len(table)), table.ref_index
        refs_param = table.ref_param
    else:
        seg_of_ref = np.repeat(np.arange(len(table)), np.diff(table.ref_start))
        mine = np.nonzero(table.ref_rank == rank)[0]
        seg, index = seg_of_ref[mine], table.ref_index[mine]
        refs_param = table.ref_param[mine]
    n = len(cols)
    ok = (index >= 0) & (index < n)
    safe = np.where(ok, index, 0)
    # the layout's param name for each ref, as an id among this plan's params (-1: not one of them)
    plan_param = {name: i for i, name in enumerate(cols.param_names)}
    layout_to_plan = np.asarray([plan_param.get(name, -1) for name in table.param_names] + [-1], dtype=np.int64)
    ok &= layout_to_plan[refs_param] == cols.param[safe]
    # per class (a handful) and gathered column by column: `.all(axis=1)` over a short axis costs ~10x
    dst_class, reps = cols.region_classes("dst")
    c_ndim, c_sizes, _ = cols.geometry_rows("dst", reps)
    klass = dst_class[safe]
    ok &= table.shape_ndim[seg] == c_ndim[klass]
    for j in range(min(table.shape.shape[1], c_sizes.shape[1])):
        ok &= table.shape[:, j][seg] == c_sizes[:, j][klass]
    dtype_id = {d: i for i, d in enumerate(table.dtypes)}
    param_dtype = np.asarray([dtype_id.get(p.dtype, -1) for p in plan.params] + [-1], dtype=np.int64)
    ok &= param_dtype[np.minimum(cols.param[safe], len(plan.params))] == table.dtype[seg]
    if not ok.all():
        j = int(np.nonzero(~ok)[0][0])
        s = table[int(seg[j])]
        ref = next(r for r in s.refs if r.rank == rank and r.index == int(index[j]))
        raise mismatch(f"rank {rank}: layout segment at byte {s.offset} ({s.dtype}{list(s.shape)} for "
                       f"{ref.param!r}, write {ref.index}) does not match the plan: compute the layout from the same "
                       f"plans")
    numels = np.asarray([p.numel for p in plan.params] + [0], dtype=np.int64)
    lo, hi, empty = class_extents(cols, "dst", index)
    bad = ~empty & ((lo < 0) | (hi > numels[cols.param[index]]))
    if bad.any():
        j = int(np.nonzero(bad)[0][0])
        i = int(index[j])
        name = cols.param_names[cols.param[i]]
        raise PlanError(f"rank {rank}: write {i} writes elements [{int(lo[j])}, {int(hi[j])}) of {name!r}, which "
                        f"has {int(numels[cols.param[i]])}")
    seen = np.zeros(n, dtype=bool)
    seen[index] = True
    names = layout.group_names
    # a layout of one part of a split group holds only some of the group's writes: nothing to check against
    groups = set() if len(names) == 1 and "/" in names[0] else {base_group(g) for g in names}
    if groups:
        in_groups = np.asarray([group_cached(name) in groups for name in cols.param_names], dtype=bool)
        missing = np.nonzero(~seen & in_groups[cols.param])[0].tolist()
        if missing:
            raise mismatch(f"rank {rank}: writes {missing[:8]} (of {len(missing)}) have no segment in the layout: "
                           f"compute the layout from the same plans")
    live = table.nbytes[seg] > 0
    seg, index = seg[live], index[live]
    dst_class, reps = cols.region_classes("dst")
    geo = dst_class[index]
    geometry = [collapse(sizes, strides) for sizes, strides in region_tuples(cols, "dst", reps)]
    return Placement(index, table.offset[seg], cols.param[index], cols.dst_offset[index], geo, geometry,
                     table.dtype[seg], table.dtypes, seen)


def overlap_steps(cols: WriteColumns, placed: Placement, metas) -> np.ndarray:
    """Overlap level per placed write (a write comes after every earlier-in-plan write whose destination overlaps
    it). Writes overlapping none are level 0 (overlap.overlapping_writes: extents, then boxes where extents meet);
    the few that may (a rank's ordered writes) go through overlap.overlap_levels. `metas`: the plan's params."""
    index = placed.write
    levels = np.zeros(len(index), dtype=np.int64)
    if len(index) < 2:
        return levels
    lo, hi, _ = class_extents(cols, "dst", index)
    param = cols.param[index]
    may = overlapping_writes(param, cols.dst_offset[index], np.take(cols.dst_sizes, index, axis=0),
                             np.take(cols.dst_strides, index, axis=0), param_shapes(cols.param_names, metas)[param])
    rows = np.nonzero(may & (hi > lo))[0]
    if not len(rows):
        return levels
    got = overlap_levels((int(param[j]), int(lo[j]), int(hi[j]), int(index[j])) for j in rows.tolist())
    levels[rows] = [got[int(index[j])] for j in rows.tolist()]
    return levels
