"""The byte contract both sides of a sync stand on: where each write's bytes sit in a packed buffer.

`PackLayout` is a pure function of (plans, alignment, max_group_bytes): the trainer and the consumer compute it
independently from the same plan and exchange its `digest` before the first byte moves. Segments are
`alignment`-aligned, hold destination-dtype bytes in destination shape (the consumer only scatters), are grouped by
weight group (one decoder layer each, a contiguous byte range per group), and are shared by writes whose bytes are
identical (same source view, same destination dtype and shape, same group). Fallback tensors travel whole after their
layer's bytes (`fallback_slots`); sharded trainers' parts of a group sit one after the other (`sharded_bases`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from shardplan.errors import PlanError
from shardplan.plan import ir
from shardplan.plan.columns import columns_of
from shardplan.plan.names import base_group, group_of
from shardplan.runtime.segments import layout_arrays
from shardplan.runtime.tensors import align_up


@dataclass(frozen=True, slots=True)
class WriteRef:
    """One write of one consumer rank's plan: plans[rank].writes[index], writing region `dst` of `param` (kept here
    so that the layout's digest covers where every byte lands)."""

    rank: int
    index: int
    param: str
    dst: ir.Region


@dataclass(frozen=True, slots=True)
class Segment:
    """One packed blob: `nbytes` bytes at `offset` holding a `dtype` tensor of `shape` (the destination's dtype and
    sizes), for every write in `refs` (several when their bytes are identical)."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    group: str
    refs: tuple[WriteRef, ...]


@dataclass(frozen=True, slots=True)
class GroupSpan:
    """Weight group `name`: bytes [start, stop) of the buffer, segments [first, last) of the layout."""

    name: str
    start: int
    stop: int
    first: int
    last: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


class SegmentTable(Sequence):
    """A layout's segments as columns (runtime/segments.py builds them): `Segment` objects are built only when
    indexed. Per segment: offset, nbytes, dtype (id in `dtypes`), shape (`shape_ndim` dims of `shape`), group (id in
    `group_names`), its refs at [ref_start[i], ref_start[i + 1]) of the ref columns (rank, write index, param id in
    `param_names`, destination region)."""

    FIELDS = ("offset", "nbytes", "dtype", "shape_ndim", "shape", "group")
    REF_FIELDS = (
        "ref_rank",
        "ref_index",
        "ref_param",
        "ref_dst_offset",
        "ref_dst_ndim",
        "ref_dst_sizes",
        "ref_dst_strides",
    )

    def __init__(self, arrays: Mapping, dtypes, group_names, param_names):
        for k in self.FIELDS + self.REF_FIELDS + ("ref_start",):
            setattr(self, k, arrays[k])
        self.dtypes, self.group_names, self.param_names = tuple(dtypes), tuple(group_names), tuple(param_names)
        self._cache: dict[int, Segment] = {}

    @classmethod
    def from_segments(cls, segments: Sequence[Segment]) -> "SegmentTable":
        refs = [r for s in segments for r in s.refs]
        width = max([len(s.shape) for s in segments] + [len(r.dst.sizes) for r in refs] + [1])
        dtypes = sorted({s.dtype for s in segments})
        groups = list(dict.fromkeys(s.group for s in segments))
        params = list(dict.fromkeys(r.param for r in refs))

        def padded(rows, fill):
            return np.asarray([tuple(r) + (fill,) * (width - len(r)) for r in rows], dtype=np.int64).reshape(-1, width)

        arrays = {
            "offset": [s.offset for s in segments],
            "nbytes": [s.nbytes for s in segments],
            "dtype": [dtypes.index(s.dtype) for s in segments],
            "shape_ndim": [len(s.shape) for s in segments],
            "shape": padded([s.shape for s in segments], 1),
            "group": [groups.index(s.group) for s in segments],
            "ref_start": np.cumsum([0] + [len(s.refs) for s in segments]),
            "ref_rank": [r.rank for r in refs],
            "ref_index": [r.index for r in refs],
            "ref_param": [params.index(r.param) for r in refs],
            "ref_dst_offset": [r.dst.offset for r in refs],
            "ref_dst_ndim": [len(r.dst.sizes) for r in refs],
            "ref_dst_sizes": padded([r.dst.sizes for r in refs], 1),
            "ref_dst_strides": padded([r.dst.strides for r in refs], 0),
        }
        return cls({k: np.asarray(v, dtype=np.int64) for k, v in arrays.items()}, dtypes, groups, params)

    def __len__(self) -> int:
        return len(self.offset)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"segment {i} of a layout with {n} segments")
        i %= n
        seg = self._cache.get(i)
        if seg is None:
            seg = self._cache[i] = self._segment(i)
        return seg

    def _segment(self, i: int) -> Segment:
        refs = []
        for j in range(int(self.ref_start[i]), int(self.ref_start[i + 1])):
            ndim = int(self.ref_dst_ndim[j])
            dst = ir.Region(
                int(self.ref_dst_offset[j]),
                tuple(self.ref_dst_sizes[j, :ndim].tolist()),
                tuple(self.ref_dst_strides[j, :ndim].tolist()),
            )
            refs.append(
                WriteRef(int(self.ref_rank[j]), int(self.ref_index[j]), self.param_names[self.ref_param[j]], dst)
            )
        return Segment(
            int(self.offset[i]),
            int(self.nbytes[i]),
            self.dtypes[self.dtype[i]],
            tuple(self.shape[i, : self.shape_ndim[i]].tolist()),
            self.group_names[self.group[i]],
            tuple(refs),
        )

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"SegmentTable({len(self)} segments)"

    def take(self, indices, shift: int = 0, groups: Mapping[int, int] | None = None) -> "SegmentTable":
        """The listed segments (in that order), offsets moved by -shift."""
        indices = np.asarray(indices, dtype=np.int64)
        arrays = {k: getattr(self, k)[indices] for k in self.FIELDS}
        arrays["offset"] = arrays["offset"] - shift
        counts = self.ref_start[indices + 1] - self.ref_start[indices]
        starts = np.repeat(self.ref_start[indices] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        rows = starts + np.arange(int(counts.sum()))
        arrays.update({k: getattr(self, k)[rows] for k in self.REF_FIELDS})
        arrays["ref_start"] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return SegmentTable(arrays, self.dtypes, self.group_names, self.param_names)

    def params(self) -> tuple[str, ...]:
        """Names of the params the segments' refs write, sorted."""
        return tuple(sorted(self.param_names[i] for i in np.unique(self.ref_param).tolist()))

    def digest_update(self, h) -> None:
        """Feed every field to a hash; names by value (ids are renumbered by the sorted names they stand for), region
        rows without padding: equal segments hash alike whatever tables hold them."""
        named = {"dtype": self.dtypes, "group": self.group_names, "ref_param": self.param_names}
        for k in self.FIELDS + self.REF_FIELDS + ("ref_start",):
            a = np.asarray(getattr(self, k), dtype=np.int64)
            if k in named:
                used = np.unique(a)
                used_names = [named[k][i] for i in used.tolist()]
                rank = np.empty(len(used), dtype=np.int64)
                rank[np.argsort(np.asarray(used_names + [""], dtype=object)[:-1], kind="stable")] = np.arange(len(used))
                a = rank[np.searchsorted(used, a)] if len(a) else a
                h.update(repr(sorted(used_names)).encode())
            if k in ("shape", "ref_dst_sizes", "ref_dst_strides"):
                ndim = self.shape_ndim if k == "shape" else self.ref_dst_ndim
                a = a[:, : int(ndim.max()) if len(ndim) else 0]
            a = np.ascontiguousarray(a)
            h.update(k.encode() + str(a.shape).encode() + a.tobytes())


def reads_digest(plan: ir.RankPlan) -> str:
    """Hash of what each write of `plan` reads: a pure view's source name and region, a computed write's whole value
    (sources, regions and op chain). The layout's digest covers where bytes land; the sync's stamps carry this too,
    so two sides whose plans put other bytes into the same places (q and k sources swapped, the next rank's slices)
    are refused before any byte moves. Names by value, regions trimmed of padding: equal reads hash alike whatever
    tables hold them. One numpy pass per plan (stamps are computed once per side, never per pack)."""
    cols = columns_of(plan)
    h = hashlib.sha256(b"reads-v1")
    rows = np.nonzero(cols.src >= 0)[0]
    ids = cols.src[rows]
    used = np.unique(ids)
    names = [cols.sources.name(int(i)) for i in used.tolist()]
    order = np.empty(len(used), dtype=np.int64)
    order[np.argsort(np.asarray(names + [""], dtype=object)[:-1], kind="stable")] = np.arange(len(used))
    h.update(repr(sorted(names)).encode())
    ndim, sizes, strides = cols.geometry_rows("src", rows)
    width = int(ndim.max()) if len(ndim) else 0
    for a in (
        rows,
        order[np.searchsorted(used, ids)] if len(ids) else ids,
        cols.src_offset[rows],
        ndim,
        sizes[:, :width],
        strides[:, :width],
    ):
        a = np.ascontiguousarray(np.asarray(a, dtype=np.int64))
        h.update(str(a.shape).encode() + a.tobytes())
    for i in sorted(cols.computed):
        h.update(f"{i}:{cols.computed[i].src!r}".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class PackLayout:
    """Where each write's bytes sit in the packed buffer; a pure function of (plans, alignment)."""

    alignment: int
    nbytes: int
    segments: tuple[Segment, ...]
    groups: tuple[GroupSpan, ...]
    ranks: tuple[int, ...]
    base: int = 0  # byte offset of this layout inside the full layout it was cut from (0 for a full layout)
    _by_group: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.segments, SegmentTable):  # given as Segment objects
            object.__setattr__(self, "segments", SegmentTable.from_segments(tuple(self.segments)))

    @classmethod
    def from_plans(
        cls, plans: ir.RankPlan | Sequence[ir.RankPlan], alignment: int = 256, max_group_bytes: int | None = None
    ) -> "PackLayout":
        """`max_group_bytes`: split a weight group larger than this into ceil(bytes / max_group_bytes) parts of about
        equal size, "<group>/0", "<group>/1", ..., cut at segment boundaries (so a part may exceed the limit by less
        than one segment). A pipelined sync moves and applies part by part, so its fill (packing the first part) and
        drain (applying the last) shrink with the parts. Offsets do not change; both sides of a sync must use the
        same value."""
        plans = as_plans(plans)
        if alignment <= 0 or alignment % 16:
            raise ValueError(f"alignment must be a positive multiple of 16 bytes, got {alignment}")
        out = layout_arrays(plans, alignment, max_group_bytes)
        table = SegmentTable(out, out["dtypes"], out["group_names"], out["param_names"])
        spans = tuple(
            GroupSpan(table.group_names[g], start, stop, first, last) for g, start, stop, first, last in out["spans"]
        )
        return cls(alignment, out["nbytes_total"], table, spans, tuple(p.rank for p in plans))

    def group(self, name: str) -> "PackLayout":
        """The layout of one weight group alone: offsets relative to the group's first byte, so a group can be
        packed into (and applied from) its own buffer; `base` says where that buffer sits in the full one."""
        if name not in self._by_group:
            span = next((g for g in self.groups if g.name == name), None)
            if span is None:
                raise KeyError(f"weight group {name!r} is not in this layout (groups: {[g.name for g in self.groups]})")
            segments = self.segments.take(np.arange(span.first, span.last), shift=span.start)
            self._by_group[name] = PackLayout(
                self.alignment,
                span.nbytes,
                segments,
                (GroupSpan(name, 0, span.nbytes, 0, len(segments)),),
                self.ranks,
                self.base + span.start,
            )
        return self._by_group[name]

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def rank_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Byte ranges [start, stop) a consumer rank needs (adjacent segments merged): what a pull-based transport
        reads when several ranks share one buffer. Padding between a rank's adjacent segments is included."""
        table = self.segments
        seg_of_ref = np.repeat(np.arange(len(table)), np.diff(table.ref_start))
        mine = np.unique(seg_of_ref[table.ref_rank == rank])
        ranges: list[list[int]] = []
        for offset, nbytes in zip(table.offset[mine].tolist(), table.nbytes[mine].tolist()):
            if nbytes:
                stop = offset + nbytes
                if ranges and align_up(ranges[-1][1], self.alignment) >= offset:
                    ranges[-1][1] = stop
                else:
                    ranges.append([offset, stop])
        return [tuple(r) for r in ranges]

    @property
    def digest(self) -> str:
        """Hash of the whole layout (offsets, sizes, dtypes, shapes, groups, and every write's rank, index, param and
        destination region): the sync engine's trainer and consumer compare it (as part of their stamps) before the
        first byte moves."""
        h = hashlib.sha256(repr((self.alignment, self.nbytes, self.base)).encode())
        self.segments.digest_update(h)
        return h.hexdigest()[:16]

    def format(self) -> str:
        lines = [f"# layout: {self.nbytes} bytes, {len(self.segments)} segments, alignment {self.alignment}"]
        for g in self.groups:
            lines.append(f"# group {g.name}: bytes [{g.start}, {g.stop}), segments [{g.first}, {g.last})")
        for i, s in enumerate(self.segments):
            refs = ", ".join(f"r{r.rank}.w{r.index}:{r.param}" for r in s.refs)
            lines.append(f"{i}: @{s.offset} +{s.nbytes} {s.dtype}{list(s.shape)} <- {refs}")
        return "\n".join(lines)


def as_plans(plans: ir.RankPlan | Sequence[ir.RankPlan]) -> tuple[ir.RankPlan, ...]:
    plans = (plans,) if isinstance(plans, ir.RankPlan) else tuple(plans)
    ranks = [p.rank for p in plans]
    if len(set(ranks)) != len(ranks):
        raise PlanError(f"plans for one layout must be for distinct consumer ranks, got ranks {ranks}")
    return plans


# ---- what travels besides replayed writes ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FallbackSlot:
    """A fallback tensor (its loader could not be recorded) shipped whole: `nbytes` at byte `offset` of its group's
    buffer, after the group's replayed bytes. The consumer hands it to the real loader."""

    name: str
    offset: int
    nbytes: int


def fallback_slots(
    plan: ir.RankPlan, layout: PackLayout, sources: Mapping[str, ir.TensorMeta]
) -> dict[str, tuple[FallbackSlot, ...]]:
    """Where each of the plan's fallback tensors travels: appended (aligned) to the last part of its decoder layer's
    group in `layout` (so the trainer's source serves it with its layer), or a group of its own when no write of the
    plan is in that layer. Trainer and consumer compute it from the same plan, layout and sources."""
    last_part: dict[str, str] = {}
    ends = {g.name: g.nbytes for g in layout.groups}
    for g in layout.groups:
        last_part[base_group(g.name)] = g.name  # groups are in order: the last part wins
    out: dict[str, list[FallbackSlot]] = {}
    for f in sorted(plan.fallbacks, key=lambda f: f.source):
        meta = sources.get(f.source)
        if meta is None:
            raise PlanError(
                f"consumer rank {plan.rank}: fallback tensor {f.source!r} is not in the sources table, so "
                f"it cannot be shipped; pass the plan file's sources"
            )
        group = last_part.get(group_of(f.source), group_of(f.source))
        offset = align_up(ends.get(group, 0), layout.alignment)
        out.setdefault(group, []).append(FallbackSlot(f.source, offset, meta.nbytes))
        ends[group] = offset + meta.nbytes
    return {g: tuple(slots) for g, slots in out.items()}


def sharded_bases(parts: Mapping[int, PackLayout], group: str, alignment: int) -> dict[int, int]:
    """A consumer fed by sharded trainers: its buffer for `group` is the trainers' parts one after the other, in
    trainer order, each aligned (so every part is a buffer of its own for Applier/Replayer). trainer -> byte base."""
    bases, offset = {}, 0
    for t, lay in sorted(parts.items()):
        if group in lay.group_names:
            bases[t] = offset
            offset = align_up(offset + lay.group(group).nbytes, alignment)
    return bases
