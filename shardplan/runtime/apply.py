"""Consumer-side apply: scatter a received packed buffer into the destination params, batched.

`Applier(plan, layout, params)` precomputes, from the plan and the layout alone, the order constraints (writes whose
destinations overlap keep plan order: last write wins) and the batches (runs of writes into one param at a constant
stride become one strided `copy_`; leftovers of a step go through one `torch._foreach_copy_`). `apply(buffer)` builds
the buffer views once per buffer (cached by address: receive into the same registered buffer every sync) and runs.

The buffer holds destination-dtype bytes in destination shape (the trainer converted them), so applying is pure data
movement. Imports torch and shardplan's plan/runtime packages only (never the trainer's replay module, never vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from shardplan.errors import MissingTensorError, ShardplanError
from shardplan.plan import ir
from shardplan.plan.columns import WriteColumns, columns_of
from shardplan.plan.interp import region_view, to_dtype
from shardplan.plan.names import base_group
from shardplan.plan.overlap import overlap_levels, overlapping_writes, param_shapes
from shardplan.runtime.copykernel import fuse, pair_op
from shardplan.runtime.pack import PackLayout
from shardplan.runtime.segments import check_class_extents, class_extents, group_cached, region_tuples
from shardplan.runtime.tensors import (
    WIDE_DTYPES,
    PackBufferError,
    capture_graph,
    check_fits,
    check_tensor,
    collapse,
    storage_ptr,
    storage_view,
    widen,
)


class ApplyError(ShardplanError):
    """Base class for consumer-side errors."""


class LayoutMismatchError(ApplyError):
    """The layout does not describe this plan (computed from other plans, or another rank's)."""


class FallbackRequiredError(ApplyError):
    """The plan has fallback tensors (loaders that could not be recorded) and no loader was given for them."""


@dataclass(frozen=True, slots=True)
class _Item:
    """One write of this rank, placed: bytes at buffer `offset` go to `param` at element `dst_offset`."""

    write: int
    offset: int
    param: str
    dst_offset: int
    sizes: tuple[int, ...]  # collapsed destination geometry (the buffer side is contiguous)
    strides: tuple[int, ...]
    dtype: str


def params_from_plan(
    plan: ir.RankPlan, device: torch.device | str = "cpu", fill: float | None = None
) -> dict[str, torch.Tensor]:
    """Plain tensors shaped like the plan's params (for consumers without vLLM, and for tests). `fill` poisons them
    (e.g. NaN) so that unwritten elements stay visible."""
    params = {}
    check_fits(f"rank {plan.rank}'s params", sum(meta.nbytes for meta in plan.params), torch.device(device))
    for meta in plan.params:
        t = torch.empty(meta.shape, dtype=to_dtype(meta.dtype), device=device)
        if fill is not None:
            t.fill_(fill)
        params[meta.name] = t
    return params


class Applier:
    """Scatters packed buffers of `layout` into `params` for consumer rank `plan.rank`.

    `params`: name -> tensor for every param the plan writes (contiguous, plan shape and dtype): the live
    Parameters, so that a param given new storage later (`param.data = ...`) is noticed at the next apply and the
    views are bound again (a detached view, e.g. `param.data`, keeps pointing at the storage it was taken from).
    `fallback_loader(name, full_tensor)` loads plan.fallbacks (tensors the recorder could not capture), e.g.
    `lambda n, t: model.load_weights([(n, t)])`; without one, a plan with fallbacks is refused here.
    `cuda_graph`: None (default) captures the scatter of each CUDA buffer into a CUDA graph on its first apply
    (falling back to eager launches if capture fails, reason in `graph_error`); True requires it; False never.
    `box_copy` True (default): the graph replays each overlap step's copies as one Triton launch where Triton runs
    (runtime/copykernel.py; a failure there keeps the torch copies, reason in `box_copy_error`); False: torch copies.
    """

    def __init__(
        self,
        plan: ir.RankPlan,
        layout: PackLayout,
        params: Mapping[str, torch.Tensor],
        *,
        fallback_loader: Callable[[str, torch.Tensor], object] | None = None,
        cuda_graph: bool | None = None,
        box_copy: bool = True,
    ):
        self.plan, self.layout = plan, layout
        self.cuda_graph, self.box_copy = cuda_graph, box_copy
        self.graph_error: str | None = None
        self.box_copy_error: str | None = None
        if plan.fallbacks and fallback_loader is None:
            names = ", ".join(sorted(f.source for f in plan.fallbacks))
            raise FallbackRequiredError(
                f"rank {plan.rank}: these checkpoint tensors need the real vLLM loader "
                f"(recording fell back for them): {names}; pass fallback_loader=, e.g. "
                f"lambda n, t: model.load_weights([(n, t)])"
            )
        self.fallback_loader = fallback_loader
        self._metas = metas = {p.name: p for p in plan.params}
        self._columns = cols = columns_of(plan)
        self.params = {}
        for name in cols.written_params():
            check_tensor("param", name, params.get(name), metas[name], None)
            self.params[name] = params[name]
        self._placed = place(plan, cols, layout, LayoutMismatchError)
        self._bound: dict[tuple, list[Callable]] = {}
        # the params this Applier's layout writes
        touched = np.flatnonzero(np.bincount(self._placed.param, minlength=len(cols.param_names)))
        self._touched = sorted(cols.param_names[i] for i in touched.tolist())
        self._param_ptrs: list[int] | None = None  # their storage when the cached views were bound
        self._groups: dict[str, Applier] = {}
        self.applied_groups: set[str] = set()

    @classmethod
    def from_model(
        cls,
        plan: ir.RankPlan,
        layout: PackLayout,
        model: torch.nn.Module,
        *,
        fallback_loader: Callable[[str, torch.Tensor], object] | None = None,
    ) -> "Applier":
        """For a live vLLM model: its parameters and buffers themselves (so new storage is noticed, see above)."""
        tensors = dict(model.named_buffers())
        tensors.update(model.named_parameters())
        return cls(plan, layout, tensors, fallback_loader=fallback_loader)

    # -- plan-only precomputation --
    @property
    def _items(self) -> list[_Item]:
        """The placed writes as `_Item` objects (built when first needed: at the first bind)."""
        items = self.__dict__.get("_item_objects")
        if items is None:
            placed, names = self._placed, self._columns.param_names
            items = [
                _Item(w, off, names[p], dst, *placed.geometry[g], placed.dtypes[d])
                for w, off, p, dst, g, d in zip(
                    placed.write.tolist(),
                    placed.offset.tolist(),
                    placed.param.tolist(),
                    placed.dst_offset.tolist(),
                    placed.geometry_id.tolist(),
                    placed.dtype_id.tolist(),
                )
            ]
            self.__dict__["_item_objects"] = items
        return items

    @property
    def _steps(self) -> list[list[list[_Item]]]:
        """Steps (one per overlap level, in order) of runs: a run is items copied by one strided copy_."""
        return self._steps_skipping(frozenset())

    def _steps_skipping(self, skip: frozenset[int]) -> list[list[list[_Item]]]:
        """_steps without the items at the buffer offsets in `skip` (received in place: see in_place_segments)."""
        cache = self.__dict__.setdefault("_step_lists", {})
        steps = cache.get(skip)
        if steps is None:
            levels = dict(
                zip(self._placed.write.tolist(), overlap_steps(self._columns, self._placed, self._metas).tolist())
            )
            steps = [[] for _ in range(1 + max(levels.values(), default=-1))]
            for item in sorted(self._items, key=lambda it: (levels[it.write], it.offset, it.write)):
                if item.offset in skip:
                    continue
                runs = steps[levels[item.write]]
                if runs and self._extends(runs[-1], item):
                    runs[-1].append(item)
                else:
                    runs.append([item])
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            cache[skip] = steps
        return steps

    def in_place_segments(self) -> dict[int, tuple[str, int, int]]:
        """Buffer offset -> (param, first element, elements) of each segment whose bytes may be received straight into
        its param instead of the buffer (apply(skip=...) then leaves it out): the bytes of one write of this rank, into
        one contiguous range of the param, which no other write of the plan may overlap (so no write order to keep,
        whatever group or part the other writes are in)."""
        found = self.__dict__.get("_in_place")
        if found is None:
            placed, cols = self._placed, self._columns
            offsets, counts = np.unique(placed.offset, return_counts=True)
            lone = set(offsets[counts == 1].tolist())  # a segment copied into two places is applied as usual
            shared = overlapping_writes(
                cols.param,
                cols.dst_offset,
                cols.dst_sizes,
                cols.dst_strides,
                param_shapes(cols.param_names, self._metas)[cols.param],
            )
            found = {}
            for j in range(len(placed.write)):
                offset, write = int(placed.offset[j]), int(placed.write[j])
                sizes, strides = placed.geometry[int(placed.geometry_id[j])]
                if offset not in lone or shared[write] or len(sizes) != 1 or strides[0] != 1:
                    continue
                found[offset] = (cols.param_names[int(placed.param[j])], int(placed.dst_offset[j]), int(sizes[0]))
            self.__dict__["_in_place"] = found
        return found

    @staticmethod
    def _extends(run: list[_Item], item: _Item) -> bool:
        first, last = run[0], run[-1]
        if (item.param, item.sizes, item.strides, item.dtype) != (first.param, first.sizes, first.strides, first.dtype):
            return False
        if len(run) == 1:
            return item.dst_offset > first.dst_offset  # as_strided takes no negative strides
        return (
            item.offset - last.offset == run[1].offset - first.offset
            and item.dst_offset - last.dst_offset == run[1].dst_offset - first.dst_offset
        )

    # -- binding a buffer --
    def _bind(self, buffer: torch.Tensor, skip: frozenset[int] = frozenset()) -> list[Callable]:
        if (
            buffer.dtype != torch.uint8
            or buffer.dim() != 1
            or buffer.numel() != self.layout.nbytes
            or not buffer.is_contiguous()
        ):
            raise PackBufferError(
                f"rank {self.plan.rank}: buffer must be a contiguous 1-D uint8 tensor of "
                f"{self.layout.nbytes} bytes, got {str(buffer.dtype).removeprefix('torch.')}"
                f"{list(buffer.shape)}"
            )
        if buffer.data_ptr() % 16:
            raise PackBufferError(
                f"rank {self.plan.rank}: the buffer must start 16-byte aligned, it starts at {buffer.data_ptr():#x}"
            )
        ptrs = [self.params[name].data_ptr() for name in self._touched]
        if ptrs != self._param_ptrs:
            # A param got new storage since the views were bound (`param.data = ...`, an engine re-allocating its
            # weights): views and graphs bound earlier would write into the old storage, silently. Rebind all.
            if self._param_ptrs is not None:
                metas = {p.name: p for p in self.plan.params}
                for name in self._touched:
                    check_tensor("param", name, self.params[name], metas[name], None)
            self._bound.clear()
            self._param_ptrs = ptrs
        key = (buffer.data_ptr(), buffer.device, skip)
        if key not in self._bound:
            if len(self._bound) >= 4:  # cached views keep their buffers alive: remember only the last few buffers
                self._bound.pop(next(iter(self._bound)))
            for name in self._touched:  # (a group's Applier holds every param of the plan; it writes only these)
                t = self.params[name]
                if t.device != buffer.device:
                    raise PackBufferError(f"param {name!r} is on {t.device}, the buffer on {buffer.device}")
            steps = [self._step_ops(runs, buffer) for runs in self._steps_skipping(skip)]
            self._bound[key] = self._maybe_graph(steps, buffer.device)
        return self._bound[key]

    def _maybe_graph(self, steps: list[list[Callable]], device: torch.device) -> list[Callable]:
        """On CUDA (cuda_graph None or True), replace the ops by one captured graph per buffer: each step's copies
        one box-copy kernel where Triton runs (steps stay apart: a later step overwrites what an earlier one wrote)."""
        ops = [op for step in steps for op in step]
        if not ops or self.cuda_graph is False or (self.cuda_graph is None and device.type != "cuda"):
            return ops
        if self.box_copy:
            try:
                fused = [fuse(step, device) for step in steps]
                return [_replay(capture_graph(fused, device), fused)]
            except Exception as exc:
                self.box_copy_error = f"{type(exc).__name__}: {exc}"
        try:
            graph = capture_graph(steps, device)
        except Exception as exc:  # auto mode: eager launches are correct, only slower
            if self.cuda_graph:
                raise
            self.graph_error = f"{type(exc).__name__}: {exc}"
            return ops
        return [_replay(graph, steps)]

    def _step_ops(self, runs: list[list[_Item]], buffer: torch.Tensor) -> list[Callable]:
        ops, dsts, srcs = [], [], []
        for run in runs:
            dst, src = self._run_views(run, buffer)
            if len(run) > 1:
                ops.append(pair_op(lambda d=dst, s=src: d.copy_(s), [(dst, src)], "strided copy"))
            else:
                dsts.append(dst)
                srcs.append(src)
        if len(dsts) == 1:
            ops.append(pair_op(lambda d=dsts[0], s=srcs[0]: d.copy_(s), list(zip(dsts, srcs)), "copy"))
        elif dsts:
            ops.append(pair_op(lambda d=dsts, s=srcs: torch._foreach_copy_(d, s), list(zip(dsts, srcs)), "foreach"))
        return ops

    def _run_views(self, run: list[_Item], buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = run[0]
        param = self.params[first.param]
        itemsize = to_dtype(first.dtype).itemsize
        buf_base = storage_ptr(buffer) + buffer.storage_offset()
        dst_base = storage_ptr(param) + param.storage_offset() * itemsize
        offsets = [b for it in run for b in (buf_base + it.offset, dst_base + it.dst_offset * itemsize)]
        width, sizes, strides = widen(itemsize, first.sizes, first.strides, offsets)
        dtype = WIDE_DTYPES[width] if width > itemsize else to_dtype(first.dtype)
        buf_sizes, buf_strides = sizes, ir.contiguous_strides(sizes)
        dst_strides = strides
        if len(run) > 1:
            buf_sizes = (len(run),) + sizes
            buf_strides = ((run[1].offset - first.offset) // width,) + buf_strides
            dst_strides = ((run[1].dst_offset - first.dst_offset) * itemsize // width,) + strides
        src = storage_view(buffer, dtype).as_strided(
            buf_sizes, buf_strides, (buffer.storage_offset() + first.offset) // width
        )
        dst = storage_view(param, dtype).as_strided(
            buf_sizes, dst_strides, (param.storage_offset() * itemsize + first.dst_offset * itemsize) // width
        )
        return dst, src

    # -- public API --
    def apply(self, buffer: torch.Tensor, skip: frozenset[int] = frozenset()) -> None:
        """Scatter a buffer of `self.layout` (enqueued on the current stream), but the segments at the offsets in
        `skip` (of in_place_segments: their bytes were received into the params themselves)."""
        ops = self._bind(buffer, frozenset(skip))
        with torch.no_grad():
            for op in ops:
                op()
        self.applied_groups.update(self.layout.group_names)

    def for_group(self, group: str) -> "Applier":
        """The Applier of one weight group: takes the group-sized buffer `Replayer.pack_group` produced."""
        if group not in self._groups:
            self._groups[group] = Applier(
                self.plan,
                self.layout.group(group),
                self.params,
                fallback_loader=self.fallback_loader or _refuse,
                cuda_graph=self.cuda_graph,
                box_copy=self.box_copy,
            )
        return self._groups[group]

    def rebind(self, params: Mapping[str, torch.Tensor]) -> None:
        """Write into these tensors from now on (the params among them this Applier writes; others are ignored), and
        drop every cached view: for an engine that re-creates its Parameter objects (vLLM's layerwise reload
        materializes fresh ones at every update), and to let the old ones be freed (cached views keep them alive)."""
        metas = {p.name: p for p in self.plan.params}
        for name, t in params.items():
            if name in self.params:
                check_tensor("param", name, t, metas[name], None)
                self.params[name] = t
        self._bound.clear()
        self._param_ptrs = None
        for sub in self._groups.values():
            sub.rebind(params)

    def apply_group(self, group: str, buffer: torch.Tensor) -> None:
        self.for_group(group).apply(buffer)
        self.applied_groups.add(group)

    def apply_fallbacks(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hand each fallback checkpoint tensor, whole, to the fallback loader."""
        for f in self.plan.fallbacks:
            if f.source not in tensors:
                raise MissingTensorError(
                    f"fallback tensor {f.source!r} is missing: rank {self.plan.rank} needs it "
                    f"whole for the real loader ({f.loader or '?'}: {f.reason})"
                )
            self.fallback_loader(f.source, tensors[f.source])

    @property
    def num_launches(self) -> int:
        """Python-level ops per apply: one per multi-write run plus one foreach per step with single writes."""
        return sum(sum(len(r) > 1 for r in runs) + any(len(r) == 1 for r in runs) for runs in self._steps)

    def coverage(self) -> dict[str, tuple[ir.Region, ...]]:
        """param -> destination regions this Applier writes (its layout's writes), for completeness proofs."""
        regions: dict[str, list[ir.Region]] = {}
        for it in self._items:
            regions.setdefault(it.param, []).append(self._columns.dst(it.write))
        return {name: tuple(rs) for name, rs in regions.items()}

    def coverage_mask(self, name: str) -> torch.Tensor:
        """Bool tensor shaped like param `name`: True where this Applier writes."""
        meta = next(p for p in self.plan.params if p.name == name)
        mask = torch.zeros(meta.shape, dtype=torch.bool)
        for region in self.coverage().get(name, ()):
            region_view(mask, region).fill_(True)
        return mask


def _replay(graph, ops) -> Callable[[], None]:
    """The graph's replay, holding the captured ops: the graph addresses their views' storages and the box-copy
    kernel's tables by raw pointer, which must outlive it (a freed table is soon another tensor's memory)."""

    def replay(graph=graph, ops=ops) -> None:
        graph.replay()

    return replay


def _refuse(name: str, tensor: torch.Tensor) -> None:
    raise FallbackRequiredError(f"fallback tensor {name!r} needs the real vLLM loader")


# ---- plan-only work on columns: matching a layout's refs to a consumer rank's writes (every check vectorised),
# ordering the placed writes into steps of strided runs ------------------------------------------------------------
class Placement:
    """This rank's writes placed in the layout, as columns: write index, buffer offset, param id (in the plan's
    params), destination offset, collapsed geometry id (`geometry[id]` = (sizes, strides)), dtype id (in `dtypes`) per
    row; only segments with bytes. `seen`: bool per write, True where the layout has a ref for it."""

    def __init__(self, write, offset, param, dst_offset, geometry_id, geometry, dtype_id, dtypes, seen):
        self.write, self.offset, self.param, self.dst_offset = write, offset, param, dst_offset
        self.geometry_id, self.geometry, self.dtype_id, self.dtypes, self.seen = (
            geometry_id,
            geometry,
            dtype_id,
            dtypes,
            seen,
        )


def place(plan: ir.RankPlan, cols: WriteColumns, layout, mismatch) -> Placement:
    """The checks of the pre-columnar `Applier._place` (same errors), on arrays. `mismatch`: the error class for a
    layout that does not describe this plan."""
    table = layout.segments
    rank = plan.rank
    if rank not in layout.ranks:
        raise mismatch(f"the layout was computed for consumer ranks {list(layout.ranks)}, not rank {rank}")
    one_ref_each = len(table.ref_rank) == len(table) and (np.diff(table.ref_start) == 1).all()
    if one_ref_each and (table.ref_rank == rank).all():  # this rank's own layout (the usual): no gathers
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
    # per class (a handful) and gathered column by column: `.all(axis=1)` over a short axis is slower (plan/rowkeys.py)
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
        raise mismatch(
            f"rank {rank}: layout segment at byte {s.offset} ({s.dtype}{list(s.shape)} for "
            f"{ref.param!r}, write {ref.index}) does not match the plan: compute the layout from the same "
            f"plans"
        )
    numels = np.asarray([p.numel for p in plan.params] + [0], dtype=np.int64)

    def outside(j: int) -> str:
        i = int(index[j])
        lo, hi, _ = class_extents(cols, "dst", index[j : j + 1])
        return (
            f"rank {rank}: write {i} writes elements [{int(lo[0])}, {int(hi[0])}) of "
            f"{cols.param_names[cols.param[i]]!r}, which has {int(numels[cols.param[i]])}"
        )

    check_class_extents(cols, "dst", index, numels[cols.param[index]], outside)
    seen = np.zeros(n, dtype=bool)
    seen[index] = True
    names = layout.group_names
    # a layout of one part of a split group holds only some of the group's writes: nothing to check against
    groups = set() if len(names) == 1 and "/" in names[0] else {base_group(g) for g in names}
    if groups:
        in_groups = np.asarray([group_cached(name) in groups for name in cols.param_names], dtype=bool)
        missing = np.nonzero(~seen & in_groups[cols.param])[0].tolist()
        if missing:
            raise mismatch(
                f"rank {rank}: writes {missing[:8]} (of {len(missing)}) have no segment in the layout: "
                f"compute the layout from the same plans"
            )
    live = table.nbytes[seg] > 0
    seg, index = seg[live], index[live]
    dst_class, reps = cols.region_classes("dst")
    geo = dst_class[index]
    geometry = [collapse(sizes, strides) for sizes, strides in region_tuples(cols, "dst", reps)]
    return Placement(
        index,
        table.offset[seg],
        cols.param[index],
        cols.dst_offset[index],
        geo,
        geometry,
        table.dtype[seg],
        table.dtypes,
        seen,
    )


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
    may = overlapping_writes(
        param,
        cols.dst_offset[index],
        np.take(cols.dst_sizes, index, axis=0),
        np.take(cols.dst_strides, index, axis=0),
        param_shapes(cols.param_names, metas)[param],
    )
    rows = np.nonzero(may & (hi > lo))[0]
    if not len(rows):
        return levels
    got = overlap_levels((int(param[j]), int(lo[j]), int(hi[j]), int(index[j])) for j in rows.tolist())
    levels[rows] = [got[int(index[j])] for j in rows.tolist()]
    return levels
