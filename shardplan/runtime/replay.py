"""Trainer-side replay: pack the bytes a consumer rank's plan needs from the trainer's own tensors.

`Replayer` -> `BoundReplay`: binds the trainer's tensors once (validation, views, batches, optionally a CUDA graph);
`BoundReplay.pack()` then runs a handful of large copies per weight group instead of one Python `copy_` per write.
Computed writes (Call/Full/Update leaves) go through the reference interpreter, `shardplan.plan.interp`.

This module imports torch and shardplan's plan/runtime packages only: it must load on a trainer without vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from shardplan.errors import ForeignWriteError, PlanError
from shardplan.plan import ir
from shardplan.plan.columns import WriteColumns, columns_of
from shardplan.plan.interp import check_write_sizes, resolve_op, to_dtype, write_source
from shardplan.runtime.copykernel import fuse, pair_op
from shardplan.runtime.pack import GroupSpan, PackLayout, WriteRef, as_plans
from shardplan.runtime.segments import check_class_extents, class_extents, geometry_keys, ordinals
from shardplan.runtime.tensors import (
    WIDE_DTYPES,
    PackBufferError,
    StaleBindingError,
    capture_graph,
    check_fits,
    check_tensor,
    ptrs_unchanged,
    resolve_device,
    storage_ptr,
    storage_view,
    widen,
)


@dataclass(frozen=True, slots=True)
class _ViewSeg:
    """A pure-view segment, precomputed: read source `name` at `offset` with collapsed geometry."""

    segment: int
    offset: int  # buffer byte offset (relative to the layout)
    name: str
    src_offset: int  # element offset into the source
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
    `shardplan.runtime.shards`). Everything that depends only on the plans is computed here, once.
    """

    def __init__(
        self,
        plans: ir.RankPlan | Sequence[ir.RankPlan],
        sources: Mapping[str, ir.TensorMeta],
        *,
        alignment: int = 256,
        device: torch.device | str | None = None,
        max_group_bytes: int | None = None,
        layout: PackLayout | None = None,
    ):
        # `layout`: the byte arrangement of other plans with the same writes and destinations (QuantizingReplayer:
        # the plans before their sources were rebased into staging boxes), so that the consumer's own layout matches
        self.plans = as_plans(plans)
        # a plan file's source table stays templated (a dict of it would spell out ~70k names)
        self.sources = dict(sources) if isinstance(sources, dict) else sources
        self.device = torch.device(device) if device is not None else None
        self.layout = layout if layout is not None else PackLayout.from_plans(self.plans, alignment, max_group_bytes)
        self._by_rank = {p.rank: p for p in self.plans}
        self.computed_peak = check_plans(self.plans, self.sources)  # bytes one computed write makes, at most
        self._group_replayers: dict[str, Replayer] = {}

    # -- plan-only precomputation --
    def _write(self, ref: WriteRef) -> ir.Write:
        return self._by_rank[ref.rank].writes[ref.index]

    def _plan_batches(self) -> tuple[list[tuple], list[int]]:
        got = self.__dict__.get("_planned")
        if got is None:  # at first use: a caller that packs only groups or subsets never batches the whole layout
            got = self.__dict__["_planned"] = plan_batches(self.plans, self.layout.segments, self.sources)
        return got

    _runs = property(lambda self: self._plan_batches()[0])
    _computed = property(lambda self: self._plan_batches()[1])

    @property
    def _batches(self) -> list[_Batch]:
        """The runs as `_Batch` objects with their items (built at the first bind, kept)."""
        batches = self.__dict__.get("_batch_objects")
        if batches is None:
            batches = []
            for (src_dtype, dst_dtype, sizes, strides), seg_indices in self._runs:
                items = tuple(
                    _ViewSeg(seg, offset, name, src_offset, sizes, strides, math.prod(sizes))
                    for seg, offset, name, src_offset in run_items(self.plans, self.layout.segments, seg_indices)
                )
                batches.append(_Batch(src_dtype, dst_dtype, sizes, strides, items))
            self.__dict__["_batch_objects"] = batches
        return batches

    # -- public API --
    def sources_read(self, group: str | None = None) -> set[str]:
        """Names of the trainer tensors that packing (one group of) the layout reads."""
        segments = (self.layout if group is None else self.layout.group(group)).segments
        names: set[str] = set()
        first_ref = segments.ref_start[:-1]
        for plan in self.plans:
            mine = first_ref[segments.ref_rank[first_ref] == plan.rank]
            cols = columns_of(plan)
            index = segments.ref_index[mine]
            src = cols.src[index]
            for i in np.unique(src[src >= 0]).tolist():
                names.add(cols.sources.name(i))
            for i in index[src < 0].tolist():
                ir.sources(cols.computed[i].src.leaf, names)
        return names

    def for_group(self, group: str) -> "Replayer":
        """A Replayer for one weight group: packs into a group-sized buffer (layout `self.layout.group(group)`)."""
        if group not in self._group_replayers:
            sub = Replayer.__new__(Replayer)
            sub.plans, sub.sources, sub.device = self.plans, self.sources, self.device
            sub._by_rank, sub.computed_peak = self._by_rank, self.computed_peak
            sub.layout = self.layout.group(group)
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
            raise PlanError(
                f"segments {bad[:8]} are not in this layout (it has {len(lay.segments)}): subset takes "
                f"indices into layout.segments"
            )
        segs = lay.segments.take(np.asarray(segments, dtype=np.int64))
        sub = Replayer.__new__(Replayer)
        sub.plans, sub.sources, sub.device, sub._by_rank = self.plans, self.sources, self.device, self._by_rank
        sub.computed_peak = self.computed_peak
        name = lay.groups[0].name if len(lay.groups) == 1 else "subset"
        sub.layout = PackLayout(
            lay.alignment, lay.nbytes, segs, (GroupSpan(name, 0, lay.nbytes, 0, len(segs)),), lay.ranks, lay.base
        )
        sub._group_replayers = {}
        return sub

    def bind(
        self,
        tensors: Mapping[str, torch.Tensor],
        out: torch.Tensor | None = None,
        *,
        cuda_graph: bool | None = None,
        box_copy: bool = True,
    ) -> "BoundReplay":
        """Validate the trainer's tensors, build every view and batch, and on CUDA capture them in a CUDA graph.

        Contract: until re-bound, the bound tensors and `out` keep their storage (in-place updates such as optimizer
        steps are fine; `p.data = new_tensor` or reallocation is not: `pack()` then raises StaleBindingError).
        cuda_graph: None (default) captures on CUDA and falls back to eager launches if capture fails (the reason is
        kept in `BoundReplay.graph_error`); True requires the capture; False never captures. box_copy: True (default)
        has the graph copy through one Triton box-copy launch (else torch copies, why in `box_copy_error`); False: not.
        (The naive baselines, one copy_ per segment and one foreach copy, live in bench/replay_bench.py.)"""
        return BoundReplay(self, tensors, out, cuda_graph=cuda_graph, box_copy=box_copy)

    def pack(self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """One-shot bind + pack (no caching): the uint8 buffer of `self.layout`."""
        return self.bind(tensors, out).pack()

    def pack_group(
        self, group: str, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
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


class BoundReplay:
    """A Replayer bound to one set of trainer tensors and one output buffer: `pack()` replays the prepared ops."""

    def __init__(
        self,
        replayer: Replayer,
        tensors: Mapping[str, torch.Tensor],
        out: torch.Tensor | None,
        *,
        cuda_graph: bool,
        box_copy: bool = True,
    ):
        self.replayer = replayer
        self.layout = replayer.layout
        names = replayer.sources_read()
        given, device = replayer.device, None
        for name in sorted(names):
            t = tensors.get(name)
            check_tensor("trainer tensor", name, t, replayer.sources[name], given if given is not None else device)
            device = device or t.device
        # "cuda" is the current CUDA device as bind() runs (what the tensors report is always indexed)
        self.device = resolve_device(given) or device or torch.device("cpu")
        self.tensors = {name: tensors[name] for name in names}
        self.out = self._check_out(out)
        self._pinned = list(self.tensors.values()) + [self.out]
        self._pinned_ptrs = [t.data_ptr() for t in self._pinned]
        self._pinned_index = list(range(len(self._pinned)))
        self._graph = None
        self._ops = self._batched_ops()
        self._eager_ops = self._computed_ops()
        self.graph_error: str | None = None
        self.box_copy_error: str | None = None
        self.box_copy = None  # the copykernel.BoxCopy the graph replays, if any
        if cuda_graph or (cuda_graph is None and self.device.type == "cuda" and self._ops):
            try:
                self._graph = self._capture(box_copy)
            except Exception as exc:  # auto mode: eager launches are correct, only slower
                if cuda_graph:
                    raise
                self.graph_error = f"{type(exc).__name__}: {exc}"

    def _capture(self, box_copy: bool):
        """The graph of the ops, its copies as one box-copy kernel where Triton runs (runtime/copykernel.py); the
        plain ops' graph if that kernel fails (the reason in `box_copy_error`)."""
        if box_copy:
            try:
                ops = fuse(self._ops, self.device)
                graph = capture_graph([ops], self.device)
                self.box_copy = next((op.box_copy for op in ops if hasattr(op, "box_copy")), None)
                self._graph_ops = ops  # (the graph reads their views and tables by raw pointer: kept alive)
                return graph
            except Exception as exc:
                self.box_copy_error = f"{type(exc).__name__}: {exc}"
        return capture_graph([self._ops], self.device)

    def _check_out(self, out: torch.Tensor | None) -> torch.Tensor:
        nbytes = self.layout.nbytes
        check_fits("packing this layout", (nbytes if out is None else 0) + self.replayer.computed_peak, self.device)
        if out is None:
            # zeros, not empty: padding bytes are never written, and a deterministic buffer checksums reproducibly
            return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes or not out.is_contiguous():
            raise PackBufferError(
                f"out must be a contiguous 1-D uint8 tensor of {nbytes} bytes, got "
                f"{str(out.dtype).removeprefix('torch.')}{list(out.shape)}"
            )
        if out.device != self.device:
            raise PackBufferError(f"out is on {out.device}, the trainer tensors on {self.device}")
        if out.data_ptr() % 16:
            raise PackBufferError(
                f"out starts at an address that is not 16-byte aligned ({out.data_ptr():#x}): "
                f"segments are addressed in their dtype and in up to 8-byte words"
            )
        return out

    # -- building ops --
    def _buffer_view(self, dtype: torch.dtype, sizes, strides, byte_offset: int) -> torch.Tensor:
        itemsize = dtype.itemsize
        base = self.out.storage_offset() + byte_offset  # divisible: out is 16-byte aligned, offsets 16-aligned
        return storage_view(self.out, dtype).as_strided(sizes, strides, base // itemsize)

    def _src_view(self, item: _ViewSeg, dtype: torch.dtype, width: int, sizes, strides) -> torch.Tensor:
        t = self.tensors[item.name]
        byte_offset = (t.storage_offset() + item.src_offset) * t.element_size()
        return storage_view(t, WIDE_DTYPES[width] if width else dtype).as_strided(
            sizes, strides, byte_offset // (width or dtype.itemsize)
        )

    def _batched_ops(self) -> list[Callable[[], object]]:
        ops: list[Callable[[], object]] = []
        foreach_dst: list[torch.Tensor] = []
        foreach_src: list[torch.Tensor] = []
        for batch in self.replayer._batches:
            ops.extend(self._batch_ops(batch, list(batch.items), foreach_dst, foreach_src))
        if foreach_dst:
            ops.append(
                pair_op(
                    lambda d=foreach_dst, s=foreach_src: torch._foreach_copy_(d, s),
                    list(zip(foreach_dst, foreach_src)),
                    f"foreach_copy x{len(foreach_dst)}",
                )
            )
        return ops

    def _batch_ops(self, batch: _Batch, items: list[_ViewSeg], foreach_dst, foreach_src) -> list[Callable]:
        """One batch -> few ops: per source storage, items at a constant stride in both the source storage and the
        buffer become one strided copy (stacked experts, flat trainer buffers); the rest is stacked with torch.stack
        (one batched-cat kernel per 64 inputs on CUDA) in constant-stride runs; leftovers join one _foreach_copy_."""
        src_dtype, dst_dtype = to_dtype(batch.src_dtype), to_dtype(batch.dst_dtype)
        if src_dtype != dst_dtype:
            # conversion: no byte reinterpretation possible; copy_ converts (rare: e.g. fp32 checkpoint norms -> bf16)
            for item in items:
                foreach_dst.append(
                    self._buffer_view(dst_dtype, batch.sizes, ir.contiguous_strides(batch.sizes), item.offset)
                )
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
        itemsize = to_dtype(batch.src_dtype).itemsize
        addresses = []
        for item in items:
            addresses += [
                storage_ptr(self.tensors[item.name]) + self._src_byte(item),
                storage_ptr(self.out) + self.out.storage_offset() + item.offset,
            ]
        return widen(itemsize, batch.sizes, batch.strides, addresses, max_width=max(8, itemsize))

    def _views(self, run: list[_ViewSeg], geometry) -> tuple[torch.Tensor, object]:
        """Buffer view [len(run), *sizes] (constant stride) and the list of source views, in units of `width`."""
        width, sizes, strides = geometry
        dtype = WIDE_DTYPES[width]
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
            return pair_op(
                lambda d=dst, s=src: d.copy_(s),
                [(dst, src)],
                f"strided copy x{len(run)} {list(sizes)}x{width}B strides {list(strides)}",
            )
        return pair_op(
            lambda d=dst, s=srcs: torch.stack(s, out=d),
            [(dst[k], s) for k, s in enumerate(srcs)],
            f"stack x{len(run)} {list(sizes)}x{width}B strides {list(strides)}",
        )

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
        if ptrs_unchanged(self._pinned, self._pinned_ptrs, self._pinned_index):
            return
        for t, ptr in zip(self._pinned, self._pinned_ptrs):
            if t.data_ptr() != ptr:
                name = next((n for n, x in self.tensors.items() if x is t), "out")
                raise StaleBindingError(
                    f"{name!r} no longer has the storage it had at bind(): call "
                    f"Replayer.bind() again after reallocating trainer tensors or the buffer"
                )

    def pack(self, *, check: bool = True) -> torch.Tensor:
        """Fill `self.out` (enqueued on the current stream; synchronize before reading on another stream). With a
        CUDA graph the check runs on the host while the GPU replays it: the graph's views keep the bound storages
        alive, so a re-bound tensor's old bytes are read (never freed memory), and the check raises before the
        buffer is returned."""
        with torch.no_grad():
            if self._graph is not None:
                self._graph.replay()
                if check:
                    self.check()
            else:
                if check:
                    self.check()
                for op in self._ops:
                    op()
            for op in self._eager_ops:
                op()
        return self.out

    @property
    def num_launches(self) -> int:
        """Python-level ops per pack (each one or a few kernels): the batching's figure of merit."""
        return (1 if self._graph is not None else len(self._ops)) + len(self._eager_ops)


# ---- plan-only work on columns: checking the plans against the trainer's sources table, cutting the layout's
# pure-view segments into batches, without one Python object per write -----------------------------------------
def source_numels(cols: WriteColumns, ids: np.ndarray, sources: Mapping[str, ir.TensorMeta]) -> np.ndarray:
    """Elements of each source as `sources` describes it (-1 where it does not hold the name)."""
    return cols.sources.numels(ids, sources)


def source_dtypes(
    cols: WriteColumns, ids: np.ndarray, sources: Mapping[str, ir.TensorMeta]
) -> tuple[np.ndarray, list[str]]:
    """(code per id, dtype names the codes index) as `sources` describes the tensors; vectorised when `sources` is
    the plan file's own table."""
    table = cols.sources
    got = table.dtype_codes(ids, sources)
    if got is not None:
        return got
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
                    raise PlanError(
                        f"rank {plan.rank}: write {index} ({w.param}) reads {name!r}, which the "
                        f"sources table does not describe"
                    )
            for op in ir.literal_ops(w.src.leaf):
                resolve_op(op)
            problem = ir.foreign_write(w.src.leaf)
            if problem is not None:
                raise ForeignWriteError(
                    f"rank {plan.rank}: write {index} ({w.param}): {problem}. Replay never writes "
                    f"into the trainer's tensors: re-record the plan"
                )
            if rank_numel is None:
                rank_numel = sum(p.numel for p in plan.params)
            try:  # sized here, on meta, so that pack never allocates more than the plan declares room for
                peak = max(peak, check_write_sizes(w, sources, rank_numel))
            except PlanError as e:
                raise type(e)(f"rank {plan.rank}: write {index} ({w.param}): {e}. Re-record the plan") from None
            except Exception as e:  # noqa: BLE001 - an op that does not evaluate on these shapes fails replay too
                raise PlanError(
                    f"rank {plan.rank}: write {index} ({w.param}) does not evaluate on the declared "
                    f"shapes: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                ) from None
        rows = np.nonzero(cols.src >= 0)[0]
        if not len(rows):
            continue
        numel = source_numels(cols, cols.src[rows], sources)
        if (numel < 0).any():
            index = int(rows[np.nonzero(numel < 0)[0][0]])
            raise PlanError(
                f"rank {plan.rank}: write {index} ({cols.param_names[cols.param[index]]}) reads "
                f"{cols.source_name(index)!r}, which the sources table does not describe"
            )

        def outside(j: int) -> str:
            index = int(rows[j])
            meta = sources[cols.source_name(index)]
            lo, hi, _ = class_extents(cols, "src", rows[j : j + 1])
            return (
                f"rank {plan.rank}: write {index} ({cols.param_names[cols.param[index]]}) reads elements "
                f"[{int(lo[0])}, {int(hi[0])}) of {meta.name!r}, which has {meta.numel} "
                f"({meta.dtype}{list(meta.shape)})"
            )

        check_class_extents(cols, "src", rows, numel, outside)
        geo_id, geo_table = geometry_keys(cols)
        unbroadcastable = np.asarray([src is None for src, _ in geo_table], dtype=bool)[geo_id[rows]]
        if unbroadcastable.any():
            index = int(rows[np.nonzero(unbroadcastable)[0][0]])
            w = cols.write(index)
            raise PlanError(
                f"rank {plan.rank}: write {index} ({w.param}): source sizes "
                f"{list(w.src.region.sizes)} do not broadcast to {list(w.dst.sizes)}"
            )
    return peak


def plan_batches(
    plans: Sequence[ir.RankPlan], segments, sources: Mapping[str, ir.TensorMeta]
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
    key_parts = np.zeros((num, 3), dtype=np.int64)  # source dtype, geometry, plan position (global ordinals)
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
    for k in keys:  # 1-D compares: `.any(axis=1)` over a short axis is slower (plan/rowkeys.py)
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
