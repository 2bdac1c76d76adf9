"""Trainer-side replay: evaluate a consumer rank's plan on the trainer's tensors and pack the bytes it needs.

Three layers, each usable alone:

* `resolve_op` / `eval_view`: the reference interpreter of the IR (the oracle every fast path is tested against).
* `PackLayout`: where each write's bytes sit in the packed uint8 buffer. Computed from the plans alone, so the trainer
  and the consumer derive the same layout independently (compare `PackLayout.digest` to be sure). Segments are
  `alignment`-aligned, hold destination-dtype bytes in destination shape (the consumer only scatters), are grouped by
  weight group (one decoder layer each, contiguous byte range per group), and are shared by writes whose bytes are
  identical (same source view, same destination dtype and shape, same group).
* `Replayer` -> `BoundReplay`: binds the trainer's tensors once (validation, views, batches, optionally a CUDA graph);
  `BoundReplay.pack()` then runs a handful of large copies per weight group instead of one Python `copy_` per write.

This module imports torch and shardplan.ir only: it must load on a trainer without vLLM.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from . import ir
from .errors import ShardplanError


# ---- errors -------------------------------------------------------------------------------------------------
class ReplayError(ShardplanError):
    """Base class for errors raised while replaying or packing a plan."""


class DisallowedOpError(ReplayError):
    """A plan names an op outside `ir.ALLOWED_OPS` (plans name ops, never carry code)."""


class PlanError(ReplayError):
    """The plan itself is inconsistent (unknown source, out-of-bounds region, unbroadcastable write)."""


class MissingTensorError(ReplayError):
    """A tensor the plan reads (trainer side) or writes (consumer side) was not given."""


class TensorShapeError(ReplayError):
    """A given tensor's shape differs from the one the plan was recorded against."""


class TensorDTypeError(ReplayError):
    """A given tensor's dtype differs from the one the plan was recorded against."""


class TensorLayoutError(ReplayError):
    """A given tensor is not a contiguous tensor on the expected device (regions address a contiguous base)."""


class StaleBindingError(ReplayError):
    """A bound tensor or buffer no longer has the storage it had at bind time (re-bind after reallocating)."""


class PackBufferError(ReplayError):
    """The `out` buffer has the wrong size, dtype or device for the layout."""


# ---- reference interpreter ------------------------------------------------------------------------------------
def resolve_op(name: str) -> Callable:
    """The callable for an op name, through the allowlist only: "Tensor.x" -> torch.Tensor.x, "torch.x" -> torch.x."""
    if name not in ir.ALLOWED_OPS:
        raise DisallowedOpError(f"op {name!r} is not in shardplan.ir.ALLOWED_OPS; a plan may only name allowlisted "
                                f"ops: re-record the plan, or extend the allowlist if the op is a pure tensor op")
    owner, _, attr = name.partition(".")
    fn = getattr(torch.Tensor if owner == "Tensor" else torch, attr, None)
    if fn is None:
        raise DisallowedOpError(f"op {name!r} is allowlisted but torch {torch.__version__} has no such function")
    return fn


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"unknown dtype name {name!r} in plan (expected a torch dtype name such as 'bfloat16')")
    return dtype


def region_view(base: torch.Tensor, region: ir.Region) -> torch.Tensor:
    """`base.as_strided(region)` with the region's offset taken relative to `base` (as_strided's is absolute)."""
    return base.as_strided(region.sizes, region.strides, base.storage_offset() + region.offset)


def eval_view(view: ir.View, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None = None
              ) -> torch.Tensor:
    """Reference semantics of `View`: evaluate the leaf, take the region of its storage (relative to the leaf's own
    storage offset). Source leaves are contiguous tensors of the plan's shape; a Call result is addressed the way the
    recorder saw it (the op's own output strides), like `shardplan.interp`."""
    return region_view(eval_leaf(view.leaf, tensors, device), view.region)


def eval_leaf(leaf: ir.Leaf, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None = None
              ) -> torch.Tensor:
    if device is None:
        device = next((t.device for t in tensors.values()), torch.device("cpu"))
    if isinstance(leaf, ir.Source):
        if leaf.name not in tensors:
            raise MissingTensorError(f"trainer tensor {leaf.name!r} is missing: the plan reads it")
        return tensors[leaf.name]
    if isinstance(leaf, ir.Full):
        return torch.full(leaf.sizes, leaf.value, dtype=to_dtype(leaf.dtype), device=device)
    if isinstance(leaf, ir.Call):
        inputs = [eval_view(v, tensors, device) for v in leaf.inputs]
        args = [_literal(a, inputs, device) for a in leaf.args]
        kwargs = {k: _literal(v, inputs, device) for k, v in leaf.kwargs}
        result = resolve_op(leaf.op)(*args, **kwargs)
        return result if leaf.out is None else result[leaf.out]
    if isinstance(leaf, ir.Update):
        base = eval_leaf(leaf.base, tensors, device).clone()
        region_view(base, leaf.region).copy_(eval_view(leaf.value, tensors, device))
        return base
    raise PlanError(f"not a plan leaf: {leaf!r}")


def _literal(lit, inputs: list[torch.Tensor], device):
    if isinstance(lit, ir.Arg):
        return inputs[lit.index]
    if isinstance(lit, ir.DType):
        return to_dtype(lit.name)
    if isinstance(lit, ir.Slice):
        return slice(lit.start, lit.stop, lit.step)
    if isinstance(lit, ir.Const):
        return torch.tensor(lit.values, dtype=to_dtype(lit.dtype), device=device).reshape(lit.shape)
    if isinstance(lit, tuple):
        return tuple(_literal(x, inputs, device) for x in lit)
    return lit  # None, bool, int, float, str, Ellipsis


def write_source(write: ir.Write, dtype: torch.dtype, tensors: Mapping[str, torch.Tensor], device=None
                 ) -> torch.Tensor:
    """The bytes a write puts into its destination: src evaluated, broadcast to dst sizes, in the dst dtype."""
    return eval_view(write.src, tensors, device).to(dtype).expand(write.dst.sizes)


def apply_reference(plan: ir.RankPlan, tensors: Mapping[str, torch.Tensor],
                    params: Mapping[str, torch.Tensor]) -> None:
    """The plan's meaning, one write at a time, in order: what every fast path must reproduce bit for bit."""
    with torch.no_grad():
        for w in plan.writes:
            region_view(params[w.param], w.dst).copy_(eval_view(w.src, tensors, params[w.param].device))


# ---- geometry helpers -----------------------------------------------------------------------------------------
def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def broadcast_region(region: ir.Region, sizes: tuple[int, ...]) -> ir.Region | None:
    """The region as `copy_` reads it into a destination of `sizes` (broadcast dims get stride 0); None if it can't."""
    pad = len(sizes) - len(region.sizes)
    if pad < 0:
        return None
    src_sizes = (1,) * pad + tuple(region.sizes)
    src_strides = (0,) * pad + tuple(region.strides)
    strides = []
    for src_size, size, stride in zip(src_sizes, sizes, src_strides):
        if src_size == size:
            strides.append(stride)
        elif src_size == 1:
            strides.append(0)
        else:
            return None
    return ir.Region(region.offset, tuple(sizes), tuple(strides))


def collapse(sizes: Sequence[int], strides: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Fewest dims walking the same elements in the same (row-major) order: size-1 dims dropped, mergeable dims
    merged. The packed side is contiguous, so only the strided side's strides decide what merges."""
    out_sizes: list[int] = []
    out_strides: list[int] = []
    for size, stride in zip(sizes, strides):
        if size == 1:
            continue
        if out_sizes and out_strides[-1] == stride * size:
            out_sizes[-1] *= size
            out_strides[-1] = stride
        else:
            out_sizes.append(size)
            out_strides.append(stride)
    if not out_sizes:
        return (1,), (1,)
    return tuple(out_sizes), tuple(out_strides)


# Element types used to move same-dtype bytes in wider units: fewer index computations per byte in the copy kernels.
_WIDE_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def widen(itemsize: int, sizes: tuple[int, ...], strides: tuple[int, ...], byte_offsets: Iterable[int],
          max_width: int = 8) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Largest width (bytes) at which a strided view can be re-read as wider elements: innermost dim contiguous and
    every stride, size and offset divisible. Returns (width, sizes, strides) in units of that width."""
    byte_offsets = list(byte_offsets)
    width = max_width
    while width > itemsize:
        ratio = width // itemsize
        if (strides[-1] == 1 and sizes[-1] % ratio == 0 and all(s % ratio == 0 for s in strides[:-1])
                and all(o % width == 0 for o in byte_offsets)):
            return width, sizes[:-1] + (sizes[-1] // ratio,), tuple(s // ratio for s in strides[:-1]) + (1,)
        width //= 2
    return itemsize, sizes, strides


def storage_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D `dtype` tensor over t's whole storage (offset 0): lets one `as_strided` address any byte range of it in
    any element width, without autograd or view-dtype restrictions."""
    storage = t.untyped_storage()
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=t.device).set_(storage, 0, (storage.nbytes() // itemsize,), (1,))


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- layout -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WriteRef:
    """One write of one consumer rank's plan: plans[rank].writes[index], writing `param`."""
    rank: int
    index: int
    param: str


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


def group_order(group: str) -> tuple:
    """Embeddings, then decoder layers by number, then the head (and any other group by name); the parts of a
    split group ("layers.3/0", "layers.3/1": PackLayout's max_group_bytes) in part order, where the group would be."""
    base, _, part = group.partition("/")
    part_index = int(part) if part.isdigit() else -1
    if base == "embed":
        return (0, 0, "", part_index)
    if base.startswith("layers.") and base[7:].isdigit():
        return (1, int(base[7:]), "", part_index)
    return (2 if base == "head" else 3, 0, base, part_index)


def base_group(group: str) -> str:
    """The weight group a part of a split group belongs to ("layers.3/1" -> "layers.3")."""
    return group.partition("/")[0]


def _write_sort_key(w: ir.Write, dtype: str, rank_pos: int, index: int) -> tuple:
    """Layout order: group, consumer rank, views before computed writes, then geometry so that writes a kernel can
    batch (same source geometry; destinations at a constant stride) sit next to each other at a constant stride."""
    group = ir.group_of(w.param)
    if ir.is_pure_view(w):
        src = broadcast_region(w.src.region, w.dst.sizes) or w.src.region
        geometry = collapse(src.sizes, src.strides)
        tail = (w.src.leaf.name, w.src.region.offset)
        kind = 0
    else:
        geometry, tail, kind = ((), ()), ("", 0), 1
    return (group_order(group), rank_pos, kind, dtype, geometry, w.param, w.dst.sizes, w.dst.strides,
            w.dst.offset, tail, index)

def _overlap(spans: list[tuple[int, int]]) -> bool:
    """Whether any two [lo, hi) element extents intersect (extents over-approximate strided regions: a false
    positive only keeps a group whole)."""
    spans = sorted(spans)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


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
        plans = _as_plans(plans)
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
            dedup_key = (ir.group_of(w.param), w.src, dtype, w.dst.sizes)
            if dedup_key not in slots:
                slots[dedup_key] = []
                order.append(dedup_key)
            slots[dedup_key].append(WriteRef(rank, index, w.param))
        segments, groups = [], []
        offset = 0
        for dedup_key in order:
            group, _, dtype, sizes = dedup_key
            if not groups or groups[-1][0] != group:
                offset = align_up(offset, alignment)
                groups.append([group, offset, offset, len(segments), len(segments)])
            nbytes = math.prod(sizes) * _itemsize(to_dtype(dtype))
            segments.append(Segment(offset, nbytes, dtype, tuple(sizes), group, tuple(slots[dedup_key])))
            offset = align_up(offset + nbytes, alignment)
            groups[-1][2] = offset
            groups[-1][4] = len(segments)
        if max_group_bytes is not None:
            if max_group_bytes <= 0:
                raise ValueError(f"max_group_bytes must be positive, got {max_group_bytes}")
            extents: dict[tuple[str, str], list[tuple[int, int]]] = {}
            for _, _, _, w, _ in keyed:
                if w.dst.numel:
                    extents.setdefault((ir.group_of(w.param), w.param), []).append(w.dst.extent())
            keep_whole = {group for (group, _), spans in extents.items() if _overlap(spans)}
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
        """Hash of the whole layout: trainer and consumer exchange it to prove they computed the same one."""
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


def _as_plans(plans: ir.RankPlan | Sequence[ir.RankPlan]) -> tuple[ir.RankPlan, ...]:
    plans = (plans,) if isinstance(plans, ir.RankPlan) else tuple(plans)
    ranks = [p.rank for p in plans]
    if len(set(ranks)) != len(ranks):
        raise PlanError(f"plans for one layout must be for distinct consumer ranks, got ranks {ranks}")
    return plans


# ---- validation of given tensors ------------------------------------------------------------------------------
def check_tensor(role: str, name: str, t, meta: ir.TensorMeta, device: torch.device | None) -> None:
    """Named error naming the tensor and what the plan expected, for a missing, mis-shaped, mistyped, strided or
    misplaced tensor. `role` is "trainer tensor" or "param"."""
    want = f"{meta.dtype}{list(meta.shape)}"
    if t is None:
        raise MissingTensorError(f"{role} {name!r} is missing: the plan expects a {want} tensor")
    if not isinstance(t, torch.Tensor):
        raise MissingTensorError(f"{role} {name!r} is a {type(t).__name__}, not a tensor: the plan expects {want}")
    if tuple(t.shape) != tuple(meta.shape):
        raise TensorShapeError(f"{role} {name!r} has shape {list(t.shape)}, the plan expects {want}")
    if t.dtype != to_dtype(meta.dtype):
        raise TensorDTypeError(f"{role} {name!r} has dtype {str(t.dtype).removeprefix('torch.')}, "
                               f"the plan expects {want}")
    if not t.is_contiguous():
        raise TensorLayoutError(f"{role} {name!r} is not contiguous (strides {list(t.stride())}): plan regions "
                                f"address a contiguous {want} tensor; pass t.contiguous()")
    if device is not None and t.device != device:
        raise TensorLayoutError(f"{role} {name!r} is on {t.device}, expected {device}")


# ---- batched execution ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _ViewSeg:
    """A pure-view segment, precomputed: read source `name` at `offset` with collapsed geometry."""
    segment: int
    offset: int           # buffer byte offset (relative to the layout)
    name: str
    src_offset: int       # element offset into the source
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    numel: int


@dataclass(frozen=True, slots=True)
class _Batch:
    """Consecutive pure-view segments of one geometry and dtype pair: one kernel launch when bound."""
    src_dtype: str
    dst_dtype: str
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    items: tuple[_ViewSeg, ...]


class Replayer:
    """Packs the bytes of one or several consumer ranks' plans from the trainer's tensors.

    `plans`: one RankPlan (one buffer for that rank) or several (one buffer for all of them: identical bytes are
    packed once; `layout.rank_ranges(rank)` says which bytes each rank reads). `sources`: shape and dtype of each
    trainer tensor the plans read (the trainer's full HF tensors, or its local shards for plans from
    `shardplan.shards`). Everything that depends only on the plans is computed here, once.
    """

    def __init__(self, plans: ir.RankPlan | Sequence[ir.RankPlan], sources: Mapping[str, ir.TensorMeta], *,
                 alignment: int = 256, device: torch.device | str | None = None, max_group_bytes: int | None = None):
        self.plans = _as_plans(plans)
        self.sources = dict(sources)
        self.device = torch.device(device) if device is not None else None
        self.layout = PackLayout.from_plans(self.plans, alignment, max_group_bytes)
        self._by_rank = {p.rank: p for p in self.plans}
        self._check_plans()
        self._batches, self._computed = self._plan_batches()
        self._group_replayers: dict[str, Replayer] = {}

    # -- plan-only precomputation --
    def _write(self, ref: WriteRef) -> ir.Write:
        return self._by_rank[ref.rank].writes[ref.index]

    def _check_plans(self) -> None:
        for plan in self.plans:
            for index, w in enumerate(plan.writes):
                names: set[str] = set()
                ir._collect_sources(w.src.leaf, names)
                for name in sorted(names):
                    if name not in self.sources:
                        raise PlanError(f"rank {plan.rank}: write {index} ({w.param}) reads {name!r}, which the "
                                        f"sources table does not describe")
                for op in ir.literal_ops(w.src.leaf):
                    resolve_op(op)
                if ir.is_pure_view(w):
                    meta = self.sources[w.src.leaf.name]
                    lo, hi = w.src.region.extent()
                    if w.src.region.numel and (lo < 0 or hi > meta.numel):
                        raise PlanError(f"rank {plan.rank}: write {index} ({w.param}) reads elements [{lo}, {hi}) of "
                                        f"{meta.name!r}, which has {meta.numel} ({meta.dtype}{list(meta.shape)})")
                    if broadcast_region(w.src.region, w.dst.sizes) is None:
                        raise PlanError(f"rank {plan.rank}: write {index} ({w.param}): source sizes "
                                        f"{list(w.src.region.sizes)} do not broadcast to {list(w.dst.sizes)}")

    def _plan_batches(self) -> tuple[list[_Batch], list[int]]:
        batches: list[_Batch] = []
        computed: list[int] = []
        run: list[_ViewSeg] = []
        run_key = None
        for i, seg in enumerate(self.layout.segments):
            if seg.nbytes == 0:
                continue
            w = self._write(seg.refs[0])
            if not ir.is_pure_view(w):
                computed.append(i)
                continue
            src = broadcast_region(w.src.region, w.dst.sizes)
            sizes, strides = collapse(src.sizes, src.strides)
            key = (self.sources[w.src.leaf.name].dtype, seg.dtype, sizes, strides, seg.nbytes)
            item = _ViewSeg(i, seg.offset, w.src.leaf.name, src.offset, sizes, strides, math.prod(sizes))
            if key != run_key and run:
                batches.append(_Batch(*run_key[:4], tuple(run)))
                run = []
            run_key = key
            run.append(item)
        if run:
            batches.append(_Batch(*run_key[:4], tuple(run)))
        return batches, computed

    # -- public API --
    @property
    def num_batches(self) -> int:
        return len(self._batches) + len(self._computed)

    def sources_read(self, group: str | None = None) -> set[str]:
        """Names of the trainer tensors that packing (one group of) the layout reads."""
        layout = self.layout if group is None else self.layout.group(group)
        names: set[str] = set()
        for seg in layout.segments:
            ir._collect_sources(self._write(seg.refs[0]).src.leaf, names)
        return names

    def for_group(self, group: str) -> "Replayer":
        """A Replayer for one weight group: packs into a group-sized buffer (layout `self.layout.group(group)`)."""
        if group not in self._group_replayers:
            sub = Replayer.__new__(Replayer)
            sub.plans, sub.sources, sub.device = self.plans, self.sources, self.device
            sub._by_rank = self._by_rank
            sub.layout = self.layout.group(group)
            sub._batches, sub._computed = sub._plan_batches()
            sub._group_replayers = {}
            self._group_replayers[group] = sub
        return self._group_replayers[group]

    def subset(self, segments: Sequence[int]) -> "Replayer":
        """A Replayer packing only the listed segments (indices into `self.layout.segments`), each at its own offset
        in a buffer of the same size: what a trainer that serves part of a group packs (the sync engine's schedule
        splits a group between trainers). The other bytes of the buffer are left as they are."""
        lay = self.layout
        bad = [i for i in segments if not 0 <= i < len(lay.segments)]
        if bad:
            raise PlanError(f"segments {bad[:8]} are not in this layout (it has {len(lay.segments)}): subset takes "
                            f"indices into layout.segments")
        segs = tuple(lay.segments[i] for i in segments)
        sub = Replayer.__new__(Replayer)
        sub.plans, sub.sources, sub.device, sub._by_rank = self.plans, self.sources, self.device, self._by_rank
        name = lay.groups[0].name if len(lay.groups) == 1 else "subset"
        sub.layout = PackLayout(lay.alignment, lay.nbytes, segs, (GroupSpan(name, 0, lay.nbytes, 0, len(segs)),),
                                lay.ranks, lay.base)
        sub._batches, sub._computed = sub._plan_batches()
        sub._group_replayers = {}
        return sub

    def bind(self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None, *,
             cuda_graph: bool | None = None, strategy: str = "batched") -> "BoundReplay":
        """Validate the trainer's tensors, build every view and batch, and on CUDA capture them in a CUDA graph.

        Contract: until re-bound, the bound tensors and `out` keep their storage (in-place updates such as optimizer
        steps are fine; `p.data = new_tensor` or reallocation is not: `pack()` then raises StaleBindingError).
        cuda_graph: None (default) captures on CUDA and falls back to eager launches if capture fails (the reason is
        kept in `BoundReplay.graph_error`); True requires the capture; False never captures.
        `strategy` exists for benchmarks: "batched" (default), "batched-nowiden", "foreach" (one
        torch._foreach_copy_ for all pure views) or "loop" (one copy_ per segment, the naive replay)."""
        return BoundReplay(self, tensors, out, cuda_graph=cuda_graph, strategy=strategy)

    def pack(self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """One-shot bind + pack (no caching): the uint8 buffer of `self.layout`."""
        return self.bind(tensors, out).pack()

    def pack_group(self, group: str, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Pack one weight group into its own buffer (`layout.group(group).nbytes` bytes); `tensors` need only
        hold that group's sources (`sources_read(group)`)."""
        return self.for_group(group).pack(tensors, out)


def _constant_stride_runs(items: list, key) -> list[list]:
    """Split items (in order) into maximal runs whose buffer offsets, and `key(item)` if given, advance by one
    positive constant: what a single strided view can cover."""
    runs: list[list] = []
    for item in items:
        if runs and _continues(runs[-1], item, key):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _continues(run: list, item, key) -> bool:
    first, last = run[0], run[-1]
    steps = [(item.offset - last.offset, run[1].offset - first.offset if len(run) > 1 else None)]
    if key is not None:
        steps.append((key(item) - key(last), key(run[1]) - key(first) if len(run) > 1 else None))
    return all(step > 0 and (want is None or step == want) for step, want in steps)


def _labelled(fn: Callable, label: str) -> Callable:
    """Attach a description to an op (benchmarks print per-op timings with it)."""
    fn.label = label
    return fn


def capture_graph(ops: Sequence[Callable[[], object]], device: torch.device) -> "torch.cuda.CUDAGraph":
    """Run `ops` once on a side stream (lazy init, workspaces), then capture them into a CUDA graph. The ops must
    not allocate or synchronize (copies between prepared views don't)."""
    if device.type != "cuda":
        raise ReplayError(f"a CUDA graph needs CUDA tensors, these are on {device}")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        for op in ops:
            op()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        for op in ops:
            op()
    return graph


class BoundReplay:
    """A Replayer bound to one set of trainer tensors and one output buffer: `pack()` replays the prepared ops."""

    def __init__(self, replayer: Replayer, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None, *,
                 cuda_graph: bool, strategy: str):
        self.replayer = replayer
        self.layout = replayer.layout
        names = replayer.sources_read()
        device = replayer.device
        for name in sorted(names):
            t = tensors.get(name)
            check_tensor("trainer tensor", name, t, replayer.sources[name], device)
            device = device or t.device
        self.device = device or torch.device("cpu")
        self.tensors = {name: tensors[name] for name in names}
        self.out = self._check_out(out)
        self._pinned = list(self.tensors.values()) + [self.out]
        self._pinned_ptrs = [t.data_ptr() for t in self._pinned]
        self._graph = None
        self._max_width = 8
        if strategy == "batched-nowiden":  # for benchmarks: the batched path without byte reinterpretation
            strategy, self._max_width = "batched", 1
        if strategy == "batched":
            self._ops = self._batched_ops()
        elif strategy in ("foreach", "loop"):
            self._ops = self._simple_ops(strategy)
        else:
            raise ValueError(f"unknown strategy {strategy!r}: expected 'batched', 'batched-nowiden', 'foreach' or "
                             f"'loop'")
        self._eager_ops = self._computed_ops()
        self.graph_error: str | None = None
        if cuda_graph or (cuda_graph is None and self.device.type == "cuda" and self._ops):
            try:
                self._graph = capture_graph(self._ops, self.device)
            except Exception as exc:  # auto mode: eager launches are correct, only slower
                if cuda_graph:
                    raise
                self.graph_error = f"{type(exc).__name__}: {exc}"

    def _check_out(self, out: torch.Tensor | None) -> torch.Tensor:
        nbytes = self.layout.nbytes
        if out is None:
            # zeros, not empty: padding bytes are never written, and a deterministic buffer checksums reproducibly
            return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes or not out.is_contiguous():
            raise PackBufferError(f"out must be a contiguous 1-D uint8 tensor of {nbytes} bytes, got "
                                  f"{str(out.dtype).removeprefix('torch.')}{list(out.shape)}")
        if out.device != self.device:
            raise PackBufferError(f"out is on {out.device}, the trainer tensors on {self.device}")
        if out.data_ptr() % 16:
            raise PackBufferError(f"out starts at an address that is not 16-byte aligned ({out.data_ptr():#x}): "
                                  f"segments are addressed in their dtype and in up to 8-byte words")
        return out

    # -- building ops --
    def _buffer_view(self, dtype: torch.dtype, sizes, strides, byte_offset: int) -> torch.Tensor:
        itemsize = _itemsize(dtype)
        base = self.out.storage_offset() + byte_offset  # divisible: out is 16-byte aligned, offsets 16-aligned
        return storage_view(self.out, dtype).as_strided(sizes, strides, base // itemsize)

    def _src_view(self, item: _ViewSeg, dtype: torch.dtype, width: int, sizes, strides) -> torch.Tensor:
        t = self.tensors[item.name]
        byte_offset = (t.storage_offset() + item.src_offset) * t.element_size()
        return storage_view(t, _WIDE_DTYPES[width] if width else dtype).as_strided(
            sizes, strides, byte_offset // (width or _itemsize(dtype)))

    def _batched_ops(self) -> list[Callable[[], object]]:
        ops: list[Callable[[], object]] = []
        foreach_dst: list[torch.Tensor] = []
        foreach_src: list[torch.Tensor] = []
        for batch in self.replayer._batches:
            ops.extend(self._batch_ops(batch, list(batch.items), foreach_dst, foreach_src))
        if foreach_dst:
            ops.append(_labelled(lambda d=foreach_dst, s=foreach_src: torch._foreach_copy_(d, s),
                                 f"foreach_copy x{len(foreach_dst)}"))
        return ops

    def _batch_ops(self, batch: _Batch, items: list[_ViewSeg], foreach_dst, foreach_src) -> list[Callable]:
        """One batch -> few ops: per source storage, items at a constant stride in both the source storage and the
        buffer become one strided copy (stacked experts, flat trainer buffers); the rest is stacked with torch.stack
        (one batched-cat kernel per 64 inputs on CUDA) in constant-stride runs; leftovers join one _foreach_copy_."""
        src_dtype, dst_dtype = to_dtype(batch.src_dtype), to_dtype(batch.dst_dtype)
        if src_dtype != dst_dtype:
            # conversion: no byte reinterpretation possible; copy_ converts (rare: e.g. fp32 checkpoint norms -> bf16)
            for item in items:
                foreach_dst.append(self._buffer_view(dst_dtype, batch.sizes, ir.contiguous_strides(batch.sizes),
                                                     item.offset))
                foreach_src.append(self._src_view(item, src_dtype, 0, batch.sizes, batch.strides))
            return []
        geometry = self._widened(batch, items)
        by_storage: dict[int, list[_ViewSeg]] = {}
        for item in items:
            by_storage.setdefault(storage_ptr(self.tensors[item.name]), []).append(item)
        ops, rest = [], []
        for group in by_storage.values():
            for run in _constant_stride_runs(group, lambda it: self._src_byte(it)):
                if len(run) > 1:
                    ops.append(self._copy_op(run, geometry, strided_source=True))
                else:
                    rest.extend(run)
        rest.sort(key=lambda it: it.offset)
        for run in _constant_stride_runs(rest, None):
            if len(run) == 1 or len(geometry[1]) >= 4:  # torch.cat's batched kernel takes at most 4 dims
                for item in run:
                    dst, src = self._views([item], geometry)
                    foreach_dst.append(dst[0])
                    foreach_src.append(src)
            else:
                ops.append(self._copy_op(run, geometry, strided_source=False))
        return ops

    def _src_byte(self, item: _ViewSeg) -> int:
        t = self.tensors[item.name]
        return (t.storage_offset() + item.src_offset) * t.element_size()

    def _widened(self, batch: _Batch, items: list[_ViewSeg]) -> tuple[int, tuple, tuple]:
        itemsize = _itemsize(to_dtype(batch.src_dtype))
        addresses = []
        for item in items:
            addresses += [storage_ptr(self.tensors[item.name]) + self._src_byte(item),
                          storage_ptr(self.out) + self.out.storage_offset() + item.offset]
        return widen(itemsize, batch.sizes, batch.strides, addresses, max_width=max(self._max_width, itemsize))

    def _views(self, run: list[_ViewSeg], geometry) -> tuple[torch.Tensor, object]:
        """Buffer view [len(run), *sizes] (constant stride) and the list of source views, in units of `width`."""
        width, sizes, strides = geometry
        dtype = _WIDE_DTYPES[width]
        out_stride = (run[1].offset - run[0].offset) // width if len(run) > 1 else math.prod(sizes)
        dst = self._buffer_view(dtype, (len(run),) + sizes, (out_stride,) + ir.contiguous_strides(sizes), run[0].offset)
        srcs = [self._src_view(item, None, width, sizes, strides) for item in run]
        return dst, (srcs[0] if len(srcs) == 1 else srcs)

    def _copy_op(self, run: list[_ViewSeg], geometry, strided_source: bool) -> Callable:
        width, sizes, strides = geometry
        dst, srcs = self._views(run, geometry)
        if strided_source:
            step = (self._src_byte(run[1]) - self._src_byte(run[0])) // width
            src = self._src_view(run[0], None, width, (len(run),) + sizes, (step,) + strides)
            return _labelled(lambda d=dst, s=src: d.copy_(s),
                             f"strided copy x{len(run)} {list(sizes)}x{width}B strides {list(strides)}")
        return _labelled(lambda d=dst, s=srcs: torch.stack(s, out=d),
                         f"stack x{len(run)} {list(sizes)}x{width}B strides {list(strides)}")

    def _simple_ops(self, strategy: str) -> list[Callable]:
        dsts, srcs = [], []
        for batch in self.replayer._batches:
            src_dtype, dst_dtype = to_dtype(batch.src_dtype), to_dtype(batch.dst_dtype)
            for item in batch.items:
                dsts.append(self._buffer_view(dst_dtype, batch.sizes, ir.contiguous_strides(batch.sizes), item.offset))
                srcs.append(self._src_view(item, src_dtype, 0, batch.sizes, batch.strides))
        if strategy == "foreach":
            return [lambda: torch._foreach_copy_(dsts, srcs)] if dsts else []
        return [lambda d=d, s=s: d.copy_(s) for d, s in zip(dsts, srcs)]

    def _computed_ops(self) -> list[Callable]:
        """Non-view segments (Call/Full/Update leaves) go through the reference interpreter, once per segment."""
        ops = []
        for i in self.replayer._computed:
            seg = self.layout.segments[i]
            w = self.replayer._write(seg.refs[0])
            dtype = to_dtype(seg.dtype)
            dst = self._buffer_view(dtype, seg.shape, ir.contiguous_strides(seg.shape), seg.offset)
            ops.append(lambda d=dst, w=w, dtype=dtype: d.copy_(write_source(w, dtype, self.tensors, self.device)))
        return ops

    # -- running --
    def check(self) -> None:
        """Raise StaleBindingError if a bound tensor or the buffer was reallocated since bind()."""
        if list(map(torch.Tensor.data_ptr, self._pinned)) == self._pinned_ptrs:  # ~0.1-0.5 us per tensor
            return
        for t, ptr in zip(self._pinned, self._pinned_ptrs):
            if t.data_ptr() != ptr:
                name = next((n for n, x in self.tensors.items() if x is t), "out")
                raise StaleBindingError(f"{name!r} no longer has the storage it had at bind(): call "
                                        f"Replayer.bind() again after reallocating trainer tensors or the buffer")

    def pack(self, *, check: bool = True) -> torch.Tensor:
        """Fill `self.out` (enqueued on the current stream; synchronize before reading on another stream)."""
        if check:
            self.check()
        with torch.no_grad():
            if self._graph is not None:
                self._graph.replay()
            else:
                for op in self._ops:
                    op()
            for op in self._eager_ops:
                op()
        return self.out

    @property
    def num_launches(self) -> int:
        """Python-level ops per pack (each one or a few kernels): the batching's figure of merit."""
        return (1 if self._graph is not None else len(self._ops)) + len(self._eager_ops)
