"""The quantizing replay's plan geometry, on columns: which checkpoint tensors are quantized weights, the box of each
one a rank's pack quantizes, the check that its fp8 reads are whole blocks or lie in scale blocks the rank reads, and
the plans with those reads rebased into the staged boxes, all as numpy passes over the writes (runtime/quantize.py
has the rules; a Qwen3-30B-A3B FP8 rank has ~56k writes and ~18k quantized weights: one Python object per write or
name cost seconds). Tensors are known by their ids in one `SourceIds` table; names are spelled out only where a
caller asks for them (a group's bind, an error).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
import numpy.ma  # noqa: F401 - np.unique imports it at its first call (~15 ms): paid at import, not in a build

from shardplan.plan import ir
from shardplan.plan.columns import LazyWrites, NameSourceIds, SourceIds, TableSourceIds, WriteColumns, columns_of
from shardplan.plan.names import SCALE_SUFFIX

FP8 = "float8_e4m3fn"
STAGED_DTYPES = (FP8, "float32")  # (StagedIds.ov_dtype codes: a weight's fp8 box, its scales)


def row_col(region: ir.Region, cols: int) -> tuple[int, int, list[tuple[int, int]]] | None:
    """A region of a contiguous [rows, cols] tensor as a start (row, col) plus one (row step, col step) per dim,
    when no dim carries from columns into rows; else None."""
    row0, col0 = divmod(region.offset, cols)
    steps, col_hi = [], col0
    for size, stride in zip(region.sizes, region.strides):
        if size == 1 or stride == 0:
            steps.append((0, 0))
        elif stride % cols == 0:
            steps.append((stride // cols, 0))
        elif 0 < stride < cols:
            steps.append((0, stride))
            col_hi += (size - 1) * stride
        else:
            return None
    return (row0, col0, steps) if col_hi < cols else None


def source_views(view: ir.View, name: str) -> list[ir.View] | None:
    """Every View of source `name` in a write's source tree (through the inputs of computed writes), or None when
    the tree reads it some other way (an Update's base): such a read needs the whole tensor."""
    leaf = view.leaf
    if isinstance(leaf, ir.Source):
        return [view] if leaf.name == name else []
    if isinstance(leaf, ir.Call):
        out: list[ir.View] = []
        for v in leaf.inputs:
            got = source_views(v, name)
            if got is None:
                return None
            out += got
        return out
    if isinstance(leaf, ir.Update):
        if name in ir.sources(leaf.base):
            return None
        return source_views(leaf.value, name)
    return []


def rebase(region: ir.Region, shape, box) -> ir.Region:
    """`region` of the full [rows, cols] tensor, re-expressed in a contiguous tensor holding only `box`."""
    row0, col0, steps = row_col(region, shape[1])
    box_cols = box[1][1] - box[1][0]
    return ir.Region(
        (row0 - box[0][0]) * box_cols + (col0 - box[1][0]), region.sizes, tuple(r * box_cols + c for r, c in steps)
    )


def common_ids(plans: Sequence[ir.RankPlan], sources: Mapping[str, ir.TensorMeta]):
    """(one SourceIds for every plan, each plan's columns with `src` in its ids): a plan file's ranks share their
    table's; plans built from objects are renumbered over the names they read (and their weights' or scales')."""
    cols = [columns_of(p) for p in plans]
    shared = {id(c.sources) for c in cols}
    if len(shared) == 1 and isinstance(cols[0].sources, TableSourceIds) and sources is cols[0].sources.table:
        return cols[0].sources, cols
    names: set[str] = set()
    for c in cols:
        names.update(c.sources.name(i) for i in np.unique(c.src[c.src >= 0]).tolist())
        for w in c.computed.values():
            ir.sources(w.src.leaf, names)
    for name in list(names):
        names.update(n for n in (name + SCALE_SUFFIX, name.removesuffix(SCALE_SUFFIX)) if n in sources)
    ids = NameSourceIds(sorted(names), sources)
    out = []
    for c in cols:
        uniq, inverse = np.unique(c.src, return_inverse=True)
        remap = np.asarray([ids._index[c.sources.name(i)] if i >= 0 else -1 for i in uniq.tolist()], dtype=np.int64)
        classes, first = c.region_classes("src")
        table = c.geometry_rows("src", first)
        out.append(_with_src(c, remap[inverse.reshape(-1)], c.src_offset, classes, table, c.computed, ids))
    return ids, out


def _with_src(c: WriteColumns, src, offset, src_class, src_table, computed, ids: SourceIds) -> WriteColumns:
    """`c` with other source columns, the geometry as classes (`src_class`) of `src_table` (ndim, sizes, strides
    per class); the destination side kept as it is (per class where it has classes)."""
    dst_tables = "dst" in c._tables and ("dst", 1) not in c._geometry
    dst = (None, None, None) if dst_tables else (c.dst_ndim, c.dst_sizes, c.dst_strides)
    return WriteColumns(
        c.param_names,
        c.param,
        c.dst_offset,
        *dst,
        src,
        offset,
        None,
        None,
        None,
        computed,
        ids,
        classes={"src": src_class, **({"dst": c._classes["dst"]} if dst_tables else {})},
        tables={"src": src_table, **({"dst": c._tables["dst"]} if dst_tables else {})},
    )


def distinct(*ids: np.ndarray) -> np.ndarray:
    """The distinct non-negative ids of the arrays, sorted (one mask over the id range, no sort)."""
    ids = [np.asarray(a, dtype=np.int64) for a in ids]
    top = max([int(a.max()) for a in ids if len(a)] + [-1])
    seen = np.zeros(top + 1, dtype=bool)
    for a in ids:
        seen[a[a >= 0]] = True
    return np.flatnonzero(seen)


def metas(ids: SourceIds, sources: Mapping[str, ir.TensorMeta], which: np.ndarray):
    """(rows, cols, 2-D, dtype name) per id (rows/cols 0 where the tensor is not 2-D or `sources` lacks it)."""
    if isinstance(ids, TableSourceIds) and sources is ids.table:
        rows = np.searchsorted(ids.bases, which, side="right") - 1
        shapes = [s for s, _ in ids.metas_by_row]
        two = np.asarray([len(s) == 2 for s in shapes], dtype=bool)
        dim0 = np.asarray([s[0] if len(s) == 2 else 0 for s in shapes], dtype=np.int64)
        dim1 = np.asarray([s[1] if len(s) == 2 else 0 for s in shapes], dtype=np.int64)
        dtypes = np.asarray([d for _, d in ids.metas_by_row], dtype=object)
        return dim0[rows], dim1[rows], two[rows], dtypes[rows]
    got = [sources.get(ids.name(i)) if i >= 0 else None for i in which.tolist()]
    two = np.asarray([m is not None and len(m.shape) == 2 for m in got], dtype=bool)
    dim0 = np.asarray([m.shape[0] if t else 0 for m, t in zip(got, two)], dtype=np.int64)
    dim1 = np.asarray([m.shape[1] if t else 0 for m, t in zip(got, two)], dtype=np.int64)
    return dim0, dim1, two, np.asarray([m.dtype if m is not None else "" for m in got], dtype=object)


def add_scale(text: str) -> str:
    return text + SCALE_SUFFIX


def drop_scale(text: str) -> str | None:
    return text.removesuffix(SCALE_SUFFIX) if text.endswith(SCALE_SUFFIX) else None


@dataclasses.dataclass
class Reads:
    """Every read of a checkpoint tensor by the plans' writes, one row each: rank position, plan position and write
    index (-1: inside a computed write), tensor id, source offset and geometry class; per class its region's sizes
    and strides (padded to one width). A rank's writes share a few dozen geometries: the geometry work runs
    per class, and the reads only gather."""

    plan: np.ndarray
    write: np.ndarray
    src: np.ndarray
    offset: np.ndarray
    klass: np.ndarray
    sizes: np.ndarray
    strides: np.ndarray
    whole: set  # ids some write reads other than through a view (an Update's base): quantized whole
    class_base: list  # per plan position: its first class (classes are numbered plan by plan)


def plan_reads(ids: SourceIds, cols: Sequence[WriteColumns]) -> Reads:
    tables = []
    for c in cols:
        classes, first = c.region_classes("src")
        tables.append((classes, c.geometry_rows("src", first)))
    width = max([t[1].shape[1] for _, t in tables] + [1])
    parts, extra, whole, base, class_base = [], [], set(), 0, []
    cls_sizes, cls_strides = [], []
    for pos, (c, (classes, (ndim, sizes, strides))) in enumerate(zip(cols, tables)):
        class_base.append(base)
        rows = np.flatnonzero(c.src >= 0)
        pad = width - sizes.shape[1]
        cls_sizes.append(np.pad(sizes, ((0, 0), (0, pad)), constant_values=1))
        cls_strides.append(np.pad(strides, ((0, 0), (0, pad))))
        parts.append((np.full(len(rows), pos), rows, c.src[rows], c.src_offset[rows], classes[rows] + base))
        base += len(ndim)
        for w in c.computed.values():
            for name in sorted(ir.sources(w.src.leaf)):
                i = int(ids.ids_of_names([name])[0])
                views = source_views(w.src, name)  # (objects: computed writes are rare)
                if views is None:
                    whole.add(i)
                    continue
                for v in views:
                    r = v.region
                    if len(r.sizes) > width:
                        whole.add(i)
                        continue
                    pad = width - len(r.sizes)
                    extra.append((pos, -1, i, r.offset, base))  # a class of its own
                    cls_sizes.append(np.asarray([list(r.sizes) + [1] * pad], dtype=np.int64))
                    cls_strides.append(np.asarray([list(r.strides) + [0] * pad], dtype=np.int64))
                    base += 1
    if extra:
        parts.append(tuple(np.asarray(x, dtype=np.int64) for x in zip(*extra)))
    arrays = [np.concatenate([p[k] for p in parts]).astype(np.int64, copy=False) for k in range(5)]
    tables_out = [np.concatenate(t).astype(np.int64, copy=False) for t in (cls_sizes, cls_strides)]
    return Reads(*arrays, *tables_out, whole, class_base)


def boxes_of(offset, klass, sizes, strides, cols_of_read):
    """(row0, row1, col0, col1, valid, pair, steps): each read as a box of its [rows, cols] tensor (quantize.py's rule:
    each dim steps whole rows or within a row, never carrying into rows), `valid` where the rule holds. `klass`: class
    per read (rows of `sizes`/`strides`); `cols_of_read`: its tensor's columns. Steps are computed once per (class,
    width) pair: `pair` per read, `steps` = (class, row steps, col steps) per pair."""
    widths = np.unique(cols_of_read)  # a handful of distinct tensor widths
    lut = np.zeros(int(widths[-1]) + 1 if len(widths) else 1, dtype=np.int64)
    lut[widths] = np.arange(len(widths))
    pair = klass * len(widths) + lut[cols_of_read]
    pair_class = np.repeat(np.arange(len(sizes)), len(widths))
    S, T = sizes[pair_class], strides[pair_class]
    C = np.tile(widths, len(sizes))[:, None]
    safe = np.maximum(C, 1)
    active = (S != 1) & (T != 0)
    whole_rows = (T > 0) & (T % safe == 0)
    in_row = (T > 0) & (T < C)
    row_step = np.where(active & whole_rows, T // safe, 0)
    col_step = np.where(active & in_row, T, 0)
    row_reach = ((S - 1) * row_step).sum(axis=1) + 1
    col_reach = ((S - 1) * col_step).sum(axis=1) + 1
    ok = ~(active & ~whole_rows & ~in_row).any(axis=1) & (S > 0).all(axis=1)
    safe_read = np.maximum(cols_of_read, 1)
    row0, col0 = offset // safe_read, offset % safe_read
    col1 = col0 + col_reach[pair]
    valid = ok[pair] & (col1 <= cols_of_read)
    return row0, row0 + row_reach[pair], col0, col1, valid, pair, (pair_class, row_step, col_step)


def uncovered(keys, rows, cols, scale_keys, scale_rows, scale_cols) -> int:
    """Index of the first read (key, block rows [r0, r1), block cols [c0, c1)) whose blocks are not all inside the
    union of the scale reads (boxes in blocks) of the same key; -1 when every block is covered. One segmented pass:
    the scale boxes are cut into block rows, and each row's column intervals must chain from c0 to c1."""
    # the scale reads of each key: by key as CSR (keys are small non-negative ints: a count, no search)
    order = np.argsort(scale_keys, kind="stable")
    top = int(max(keys.max(initial=-1), scale_keys.max(initial=-1))) + 1
    per_key = np.bincount(scale_keys, minlength=top)
    count = per_key[keys]
    lo = (np.cumsum(per_key) - per_key)[keys]
    pair_i = np.repeat(np.arange(len(keys)), count)
    pair_j = order[np.repeat(lo, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)]
    a = np.maximum(rows[0][pair_i], scale_rows[0][pair_j])
    b = np.minimum(rows[1][pair_i], scale_rows[1][pair_j])
    c = np.maximum(cols[0][pair_i], scale_cols[0][pair_j])
    d = np.minimum(cols[1][pair_i], scale_cols[1][pair_j])
    keep = (a < b) & (c < d)
    pair_i, a, b, c, d = pair_i[keep], a[keep], b[keep], c[keep], d[keep]
    # cut along the read's shorter side (a down_proj shard is 16 block rows by 2 block cols): swap where cols are
    flip = (rows[1] - rows[0]) > (cols[1] - cols[0])
    rows, cols = (
        (np.where(flip, cols[0], rows[0]), np.where(flip, cols[1], rows[1])),
        (np.where(flip, rows[0], cols[0]), np.where(flip, rows[1], cols[1])),
    )
    f = flip[pair_i]
    a, b, c, d = np.where(f, c, a), np.where(f, d, b), np.where(f, a, c), np.where(f, b, d)
    n = b - a
    e_i, e_c, e_d = np.repeat(pair_i, n), np.repeat(c, n), np.repeat(d, n)
    e_row = np.repeat(a, n) + np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
    order = np.lexsort((e_c, e_row, e_i))
    e_i, e_row, e_c, e_d = e_i[order], e_row[order], e_c[order], e_d[order]
    start = np.ones(len(e_i), dtype=bool)
    start[1:] = (e_i[1:] != e_i[:-1]) | (e_row[1:] != e_row[:-1])
    seg = np.cumsum(start) - 1
    big = int(e_d.max(initial=0)) + 1
    reach = np.maximum.accumulate(e_d + seg * big) - seg * big  # running max of the interval ends, per row
    prev = np.empty_like(reach)
    prev[1:] = reach[:-1]
    gap = np.where(start, e_c > cols[0][e_i], e_c > prev)
    last = np.ones(len(e_i), dtype=bool)
    last[:-1] = start[1:]
    seg_gap = np.zeros(int(seg[-1]) + 1 if len(seg) else 0, dtype=bool)
    np.logical_or.at(seg_gap, seg, gap)
    row_ok = ~seg_gap & (reach[last] >= cols[1][e_i[last]])
    rows_ok = np.bincount(e_i[last][row_ok], minlength=len(keys))
    bad = np.flatnonzero(rows_ok != rows[1] - rows[0])
    return int(bad[0]) if len(bad) else -1


class Boxes(Mapping):
    """weight name -> its quantized box ((r0, r1), (c0, c1)), looked up by id (names spelled out only to iterate)."""

    def __init__(self, ids: SourceIds, weight_ids: np.ndarray, boxes: np.ndarray):
        order = np.argsort(weight_ids, kind="stable")
        self.ids, self.weight_ids, self.array = ids, weight_ids[order], boxes[order]
        self._names: list[str] | None = None

    def position(self, name: str) -> int:
        i = int(self.ids.ids_of_names([name])[0])
        at = int(np.searchsorted(self.weight_ids, i))
        return at if i >= 0 and at < len(self.weight_ids) and int(self.weight_ids[at]) == i else -1

    def __getitem__(self, name: str):
        at = self.position(name) if isinstance(name, str) else -1
        if at < 0:
            raise KeyError(name)
        r0, r1, c0, c1 = self.array[at].tolist()
        return (r0, r1), (c0, c1)

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and self.position(name) >= 0

    def names_of(self, positions) -> list[str]:
        return [self.ids.name(int(self.weight_ids[p])) for p in positions]

    def __iter__(self):
        if self._names is None:
            self._names = sorted(self.names_of(range(len(self.weight_ids))))
        return iter(self._names)

    def __len__(self) -> int:
        return len(self.weight_ids)


class StagedIds(SourceIds):
    """The ids of `base`, with the quantized weights staged as fp8 boxes and their scales as float32 box grids
    (`override`: sorted ids, rows, cols, dtype per id): what the rebased plans read."""

    def __init__(self, base: SourceIds, table: Mapping[str, ir.TensorMeta], override):
        self.base, self.base_table = base, table
        self.ov_ids, self.ov_rows, self.ov_cols, self.ov_dtype = override
        self._at: np.ndarray | None = None
        self.table = StagedTable(self)

    def _override(self, ids: np.ndarray):
        if self._at is None:  # position of each staged id, by id (a gather instead of a search per lookup)
            self._at = np.full(int(self.ov_ids.max(initial=-1)) + 2, -1, dtype=np.int64)
            self._at[self.ov_ids] = np.arange(len(self.ov_ids))
        at = self._at[np.minimum(ids, len(self._at) - 1)]
        hit = at >= 0
        return np.maximum(at, 0), hit

    def ids(self, text, holes):
        return self.base.ids(text, holes)

    def ids_of_names(self, names):
        return self.base.ids_of_names(names)

    def name(self, i: int) -> str:
        return self.base.name(i)

    def meta(self, i: int) -> ir.TensorMeta | None:
        at, hit = self._override(np.asarray([i], dtype=np.int64))
        name = self.base.name(i)
        if hit[0]:
            a = int(at[0])
            return ir.TensorMeta(
                name, (int(self.ov_rows[a]), int(self.ov_cols[a])), STAGED_DTYPES[int(self.ov_dtype[a])]
            )
        return self.base_table.get(name)

    def numels(self, ids, table=None):
        if table is not None and table is not self.table:
            return super().numels(ids, table)
        out = self.base.numels(ids, self.base_table)
        at, hit = self._override(ids)
        if not hit.any():  # also: no staged weights at all (ov_* empty, `at` would index nothing)
            return out
        return np.where(hit, self.ov_rows[at] * self.ov_cols[at], out)

    def dtype_codes(self, ids, table):
        if table is not self.table:
            return None
        got = self.base.dtype_codes(ids, self.base_table)
        codes, names = got if got is not None else (np.zeros(len(ids), dtype=np.int64), [])
        if got is None:
            names = sorted({m.dtype for m in (self.base_table.get(self.base.name(i)) for i in ids.tolist()) if m})
            index = {d: k for k, d in enumerate(names)}
            codes = np.asarray([index[self.base_table[self.base.name(i)].dtype] for i in ids.tolist()], dtype=np.int64)
        at, hit = self._override(ids)
        names = list(names) + sorted(set(STAGED_DTYPES) - set(names))
        lut = np.asarray([names.index(d) for d in STAGED_DTYPES], dtype=np.int64)
        ov_codes = lut[self.ov_dtype[at[hit]]]
        codes = codes.copy()
        codes[hit] = ov_codes
        return codes, names


class StagedTable(Mapping):
    """name -> TensorMeta of the staged sources (the checkpoint's, the quantized weights and scales as staged)."""

    def __init__(self, ids: StagedIds):
        self._ids = ids

    def __getitem__(self, name: str) -> ir.TensorMeta:
        base = self._ids.base_table[name]
        i = int(self._ids.ids_of_names([name])[0])
        return self._ids.meta(i) if i >= 0 else base

    def __contains__(self, name) -> bool:
        return name in self._ids.base_table

    def __iter__(self):
        return iter(self._ids.base_table)

    def __len__(self) -> int:
        return len(self._ids.base_table)


def rebased_plans(plans, cols, ids: StagedIds, reads: Reads, steps, moved, rebase_view) -> list[ir.RankPlan]:
    """The plans with their moved reads' new source offsets and geometry, over the staged ids (computed writes
    through `rebase_view`). `moved`: (plan position, write index, new offset, pair, box columns) per moved read; its
    geometry is its (class, width) pair's steps over its box's columns: one new class per distinct (pair, box
    columns), so the rebased columns stay in class form (the inner Replayer's checks run per class). `steps`:
    boxes_of's per pair."""
    (m_plan, m_write, m_offset, m_pair, m_cols), (pair_class, row_step, col_step) = moved, steps
    out = []
    for pos, (plan, c) in enumerate(zip(plans, cols)):
        mine = m_plan == pos
        rows, pair, box_cols = m_write[mine], m_pair[mine], m_cols[mine]
        src_offset = c.src_offset.copy()
        src_offset[rows] = m_offset[mine]
        classes, first = c.region_classes("src")
        ndim, sizes, strides = c.geometry_rows("src", first)
        src_class = classes.copy()
        if len(rows):
            span = int(box_cols.max()) + 1
            keys, inverse = np.unique(pair * span + box_cols, return_inverse=True)  # (a few dozen distinct)
            k_pair, k_cols = keys // span, keys % span
            width = sizes.shape[1]
            new_strides = row_step[k_pair, :width] * k_cols[:, None] + col_step[k_pair, :width]
            own = pair_class[k_pair] - reads.class_base[pos]
            src_class[rows] = len(ndim) + inverse.reshape(-1)
            ndim, sizes, strides = (
                np.concatenate([ndim, ndim[own]]),
                np.concatenate([sizes, sizes[own]]),
                np.concatenate([strides, new_strides]),
            )
        computed = {}
        for i, w in c.computed.items():
            view = rebase_view(w.src)
            computed[i] = w if view is w.src else ir.Write(w.param, w.dst, view)
        new = _with_src(c, c.src, src_offset, src_class, (ndim, sizes, strides), computed, ids)
        out.append(dataclasses.replace(plan, writes=LazyWrites(new)))
    return out
