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
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from shardplan.plan import ir
from shardplan.plan.interp import PlanError
from shardplan.plan.names import base_group, group_of, group_order
from shardplan.plan.overlap import overlapping_pairs
from shardplan.runtime.tensors import align_up, broadcast_region, collapse


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

    @classmethod
    def from_plans(cls, plans: ir.RankPlan | Sequence[ir.RankPlan], alignment: int = 256,
                   max_group_bytes: int | None = None) -> "PackLayout":
        """`max_group_bytes`: split a weight group larger than this into ceil(bytes / max_group_bytes) parts of about
        equal size, "<group>/0", "<group>/1", ..., cut at segment boundaries (so a part may exceed the limit by less
        than one segment). A pipelined sync moves and applies part by part, so its fill (packing the first part) and
        drain (applying the last) shrink with the parts. Offsets do not change; both sides of a sync must use the
        same value."""
        plans = as_plans(plans)
        if alignment <= 0 or alignment % 16:
            raise ValueError(f"alignment must be a positive multiple of 16 bytes, got {alignment}")
        keyed = []
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
            spans = ((w.param, *(w.dst.extent() if w.dst.numel else (0, 0)), group_of(w.param))
                     for _, _, _, w, _ in keyed)
            keep_whole = {group for group, _ in overlapping_pairs(spans)}
            groups, segments = _split_groups(groups, segments, max_group_bytes, keep_whole)
        spans = tuple(GroupSpan(*g) for g in groups)
        return cls(alignment, offset, tuple(segments), spans, tuple(p.rank for p in plans))

    def group(self, name: str) -> "PackLayout":
        """The layout of one weight group alone: offsets relative to the group's first byte, so a group can be
        packed into (and applied from) its own buffer; `base` says where that buffer sits in the full one."""
        if name not in self._by_group:
            span = next((g for g in self.groups if g.name == name), None)
            if span is None:
                raise KeyError(f"weight group {name!r} is not in this layout (groups: {[g.name for g in self.groups]})")
            segments = tuple(Segment(s.offset - span.start, s.nbytes, s.dtype, s.shape, s.group, s.refs)
                             for s in self.segments[span.first:span.last])
            self._by_group[name] = PackLayout(self.alignment, span.nbytes, segments,
                                              (GroupSpan(name, 0, span.nbytes, 0, len(segments)),), self.ranks,
                                              self.base + span.start)
        return self._by_group[name]

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def rank_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Byte ranges [start, stop) a consumer rank needs (adjacent segments merged): what a pull-based transport
        reads when several ranks share one buffer. Padding between a rank's adjacent segments is included."""
        ranges: list[list[int]] = []
        for s in self.segments:
            if s.nbytes and any(r.rank == rank for r in s.refs):
                stop = s.offset + s.nbytes
                if ranges and align_up(ranges[-1][1], self.alignment) >= s.offset:
                    ranges[-1][1] = stop
                else:
                    ranges.append([s.offset, stop])
        return [tuple(r) for r in ranges]

    def segment_of(self, rank: int) -> dict[int, int]:
        """write index -> segment index for one consumer rank."""
        return {r.index: i for i, s in enumerate(self.segments) for r in s.refs if r.rank == rank}

    @property
    def digest(self) -> str:
        """Hash of the whole layout (offsets, sizes, dtypes, shapes, groups, and every write's rank, index, param and
        destination region): the sync engine's trainer and consumer compare it (as part of their stamps) before the
        first byte moves."""
        h = hashlib.sha256(repr((self.alignment, self.nbytes, self.base, self.segments)).encode())
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


def fallback_slots(plan: ir.RankPlan, layout: PackLayout, sources: Mapping[str, ir.TensorMeta]
                   ) -> dict[str, tuple[FallbackSlot, ...]]:
    """Where each of the plan's fallback tensors travels: appended (aligned) to the last part of its decoder layer's
    group in `layout` (so the trainer's source serves it with its layer), or a group of its own when no write of the
    plan is in that layer. Trainer and consumer compute it from the same plan, layout and sources."""
    last_part: dict[str, str] = {}
    ends = {g.name: g.nbytes for g in layout.groups}
    for g in layout.groups:
        last_part[base_group(g.name)] = g.name   # groups are in order: the last part wins
    out: dict[str, list[FallbackSlot]] = {}
    for f in sorted(plan.fallbacks, key=lambda f: f.source):
        meta = sources.get(f.source)
        if meta is None:
            raise PlanError(f"consumer rank {plan.rank}: fallback tensor {f.source!r} is not in the sources table, so "
                            f"it cannot be shipped; pass the plan file's sources")
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
