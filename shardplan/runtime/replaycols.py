"""Replayer's plan-only work on columns: checking the plans against the trainer's sources table, and cutting the
layout's pure-view segments into batches, without one Python object per write (runtime/replay.py uses these)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from shardplan.plan import ir
from shardplan.plan.columns import TableSourceIds, WriteColumns, columns_of
from shardplan.plan.interp import ForeignWriteError, PlanError, check_write_sizes, resolve_op
from shardplan.runtime.packcols import class_extents, geometry_keys, ordinals


def source_numels(cols: WriteColumns, ids: np.ndarray, sources: Mapping[str, ir.TensorMeta]) -> np.ndarray:
    """Elements of each source as `sources` describes it (-1 where it does not hold the name)."""
    return cols.sources.numels(ids, sources)


def source_dtypes(cols: WriteColumns, ids: np.ndarray, sources: Mapping[str, ir.TensorMeta]
                  ) -> tuple[np.ndarray, list[str]]:
    """(code per id, dtype names the codes index) as `sources` describes the tensors; vectorised when `sources` is
    the plan file's own table."""
    table = cols.sources
    if isinstance(table, TableSourceIds) and sources is table.table:
        names = sorted({d for _, d in table.metas_by_row})
        code = {d: i for i, d in enumerate(names)}
        row_codes = np.asarray([code[d] for _, d in table.metas_by_row], dtype=np.int64)
        return row_codes[np.searchsorted(table.bases, ids, side="right") - 1], names
    dtypes = [sources[table.name(int(i))].dtype for i in ids.tolist()]
    names = sorted(set(dtypes))
    code = {d: i for i, d in enumerate(names)}
    return np.asarray([code[d] for d in dtypes], dtype=np.int64), names


def check_plans(plans: Sequence[ir.RankPlan], sources: Mapping[str, ir.TensorMeta]) -> int:
    """Every write reads tensors the sources table describes, inside their bounds, in an allowlisted way, never
    writing into them, makes tensors no larger than the plan declares room for, and broadcasts to its destination
    (Replayer's contract). Returns the most bytes one computed write makes (bind checks it against the device)."""
    peak = 0
    for plan in plans:
        cols = columns_of(plan)
        rank_numel = None
        for index in sorted(cols.computed):
            w = cols.computed[index]
            names: set[str] = set()
            ir.sources(w.src.leaf, names)
            for name in sorted(names):
                if name not in sources:
                    raise PlanError(f"rank {plan.rank}: write {index} ({w.param}) reads {name!r}, which the "
                                    f"sources table does not describe")
            for op in ir.literal_ops(w.src.leaf):
                resolve_op(op)
            problem = ir.foreign_write(w.src.leaf)
            if problem is not None:
                raise ForeignWriteError(f"rank {plan.rank}: write {index} ({w.param}): {problem}. Replay never writes "
                                        f"into the trainer's tensors: re-record the plan")
            if rank_numel is None:
                rank_numel = sum(p.numel for p in plan.params)
            try:   # sized here, on meta, so that pack never allocates more than the plan declares room for
                peak = max(peak, check_write_sizes(w, sources, rank_numel))
            except PlanError as e:
                raise type(e)(f"rank {plan.rank}: write {index} ({w.param}): {e}. Re-record the plan") from None
            except Exception as e:  # noqa: BLE001 - an op that does not evaluate on these shapes fails replay too
                raise PlanError(f"rank {plan.rank}: write {index} ({w.param}) does not evaluate on the declared "
                                f"shapes: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
        rows = np.nonzero(cols.src >= 0)[0]
        if not len(rows):
            continue
        numel = source_numels(cols, cols.src[rows], sources)
        if (numel < 0).any():
            index = int(rows[np.nonzero(numel < 0)[0][0]])
            raise PlanError(f"rank {plan.rank}: write {index} ({cols.param_names[cols.param[index]]}) reads "
                            f"{cols.source_name(index)!r}, which the sources table does not describe")
        lo, hi, empty = class_extents(cols, "src", rows)
        bad = ~empty & ((lo < 0) | (hi > numel))
        if bad.any():
            j = int(np.nonzero(bad)[0][0])
            index = int(rows[j])
            meta = sources[cols.source_name(index)]
            raise PlanError(f"rank {plan.rank}: write {index} ({cols.param_names[cols.param[index]]}) reads elements "
                            f"[{int(lo[j])}, {int(hi[j])}) of {meta.name!r}, which has {meta.numel} "
                            f"({meta.dtype}{list(meta.shape)})")
        geo_id, geo_table = geometry_keys(cols)
        unbroadcastable = np.asarray([src is None for src, _ in geo_table], dtype=bool)[geo_id[rows]]
        if unbroadcastable.any():
            index = int(rows[np.nonzero(unbroadcastable)[0][0]])
            w = cols.write(index)
            raise PlanError(f"rank {plan.rank}: write {index} ({w.param}): source sizes "
                            f"{list(w.src.region.sizes)} do not broadcast to {list(w.dst.sizes)}")
    return peak


def plan_batches(plans: Sequence[ir.RankPlan], segments, sources: Mapping[str, ir.TensorMeta]
                 ) -> tuple[list[tuple], list[int]]:
    """(runs, computed): runs of consecutive pure-view segments of one (source dtype, destination dtype, collapsed
    geometry, bytes), each `(key, segment indices, rank, write index of each one's first ref)`; the indices of the
    computed segments. Segments of no bytes are skipped."""
    num = len(segments)
    if num == 0:
        return [], []
    first_ref = segments.ref_start[:-1]
    rep_rank, rep_index = segments.ref_rank[first_ref], segments.ref_index[first_ref]
    pure = np.zeros(num, dtype=bool)
    key_parts = np.zeros((num, 3), dtype=np.int64)   # source dtype, geometry, plan position (global ordinals)
    geometries, dtype_names = [], []
    for pos, plan in enumerate(plans):
        mask = rep_rank == plan.rank
        if not mask.any():
            continue
        cols = columns_of(plan)
        index = rep_index[mask]
        src = cols.src[index]
        pure[mask] = src >= 0
        geo_id, geo_table = geometry_keys(cols)
        codes, names = source_dtypes(cols, src[src >= 0], sources)
        dtype_local = np.zeros(len(index), dtype=np.int64)
        dtype_local[src >= 0] = len(dtype_names) + codes
        dtype_names += names
        key_parts[mask, 0] = dtype_local
        key_parts[mask, 1] = len(geometries) + geo_id[index]
        geometries += [g for _, g in geo_table]
        key_parts[mask, 2] = pos
    dtype_ord, dtype_names = ordinals(dtype_names or [""])
    geo_ord, geo_values = ordinals(geometries or [((), ())])
    computed = np.nonzero(~pure & (segments.nbytes > 0))[0].tolist()
    live = np.nonzero(pure & (segments.nbytes > 0))[0]
    if not len(live):
        return [], computed
    keys = [dtype_ord[key_parts[live, 0]], segments.dtype[live], geo_ord[key_parts[live, 1]], segments.nbytes[live]]
    change = np.zeros(len(live), dtype=bool)
    change[0] = True
    for k in keys:   # 1-D compares: `.any(axis=1)` over a short axis costs ~10x
        change[1:] |= k[1:] != k[:-1]
    starts = np.flatnonzero(change)
    heads = list(zip(*(k[starts].tolist() for k in keys)))
    bounds = starts.tolist() + [len(live)]
    runs = []
    for (src_dtype, dtype, geo, _), a, b in zip(heads, bounds[:-1], bounds[1:]):
        sizes, strides = geo_values[geo]
        runs.append(((dtype_names[src_dtype], segments.dtypes[dtype], sizes, strides), live[a:b]))
    return runs, computed


def run_items(plans: Sequence[ir.RankPlan], segments, seg_indices: np.ndarray) -> list[tuple]:
    """(segment, buffer offset, source name, source element offset) of each segment of a run, from its first ref."""
    by_rank = {p.rank: p for p in plans}
    first_ref = segments.ref_start[seg_indices]
    out = []
    for seg, ref in zip(seg_indices.tolist(), first_ref.tolist()):
        cols = columns_of(by_rank[int(segments.ref_rank[ref])])
        index = int(segments.ref_index[ref])
        out.append((seg, int(segments.offset[seg]), cols.source_name(index), int(cols.src_offset[index])))
    return out
