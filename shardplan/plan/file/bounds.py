"""The box rules of a plan (docs/plan-format.md, "Box rules"), checked when a rank is instantiated and at replay.

    destination box := non-empty, not self-overlapping, non-negative sizes and strides, inside a param of the rank
    source view     := non-negative offset, sizes and strides, inside its declared checkpoint tensor
    constant fill   := non-negative sizes, no larger than the param it fills
    inside          := a non-empty box reaches only elements [0, numel) of its tensor    (check_extents: the one check)

`check_extents` and `bad_geometry` work on geometry classes (a template's writes share a handful of (sizes, strides)):
plan/file/rank.py calls them on the columns of pure-view templates, runtime/segments.py at replay and apply.
`check_bounds` walks object writes (computed and ordered ones, rare) and ends in the same two functions.

Every violation is one error, `PlanBoundsError`, naming the plan file, the rank and the box.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from shardplan.plan import ir
from shardplan.plan.file.errors import PlanBoundsError, advice


def check_extents(offset, klass, sizes, strides, numel, message: Callable[[int], str]) -> None:
    """The box rule, checked here only: every non-empty box i (element `offset[i]`, then the sizes and strides of
    its geometry class `klass[i]`, rows of `sizes` / `strides`) reaches only elements [0, numel[i]) of its tensor.
    Raises PlanBoundsError with `message(i)` for the first box i that does not. At load (plan/file/rank.py's
    columns, `_inside` here for object writes) and at replay (runtime/replay.py's sources, runtime/apply.py's
    params) alike.

    A class's reach is found once per distinct geometry table (`_reach`); per box it is two integer compares that
    cannot wrap."""
    offset, numel = np.asarray(offset), np.asarray(numel)
    if not offset.size:
        return
    before, after, empty = _reach(sizes, strides)
    if len(before) == 1:  # one geometry (the usual template): no gather
        if empty[0]:
            return
        bad = (offset < int(before[0])) | (offset > numel - int(after[0]))
    else:
        klass = np.asarray(klass)
        bad = (offset < before[klass]) | (offset > numel - after[klass])
        if empty.any():  # an empty box reaches nothing
            bad &= ~empty[klass]
    if bad.any():
        raise PlanBoundsError(message(int(np.nonzero(bad)[0][0])))


def bad_geometry(sizes, strides, destination: bool) -> np.ndarray:
    """Per box geometry (rows of `sizes` / `strides`), whether it breaks a rule of its own: a negative size or
    stride; for a destination also empty, or self-overlapping (one param element written twice)."""
    return _memo(("geometry", destination), sizes, strides, _bad_geometry)


def _bad_geometry(sizes: np.ndarray, strides: np.ndarray, destination: bool) -> np.ndarray:
    bad = (sizes < 0).any(axis=1) | (strides < 0).any(axis=1)
    if destination:
        bad |= (sizes == 0).any(axis=1) | _overlapping(sizes, strides)
    return bad


def _reach(sizes, strides) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(elements below the offset, elements from the offset on, empty) per class. Found in float64 first, so that a
    hostile class past any tensor (2^62 elements) neither wraps nor passes (it gets a reach no offset satisfies),
    then exactly in int64."""
    return _memo(("reach",), sizes, strides, _class_reach)


def _class_reach(sizes: np.ndarray, strides: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rough = (sizes.astype(np.float64) - 1) * strides
    far = (np.minimum(rough, 0).sum(axis=1) <= -_FAR) | (np.maximum(rough, 0).sum(axis=1) >= _FAR)
    reach = np.where(far[:, None], 0, sizes - 1) * np.where(far[:, None], 0, strides)  # exact: no term wraps
    before = np.where(far, np.iinfo(np.int64).max, -np.minimum(reach, 0).sum(axis=1))
    after = np.where(far, _FAR, np.maximum(reach, 0).sum(axis=1) + 1)
    return before, after, (sizes == 0).any(axis=1)


_FAR = 1 << 62  # a box reaching this many elements lies outside every tensor (a plan's are < 2^48)
_MEMO: dict[tuple, object] = {}
_MEMO_CLASSES = 64  # tables of at most this many classes are remembered (a template's: a handful)


def _memo(kind: tuple, sizes, strides, compute):
    """compute(sizes, strides, *kind[1:]) per distinct geometry table, remembered: the same templates' tables come
    back for every rank and every side, and numpy's fixed cost per call would otherwise dominate a small one."""
    sizes, strides = np.asarray(sizes, dtype=np.int64), np.asarray(strides, dtype=np.int64)  # [classes, dims]
    if len(sizes) > _MEMO_CLASSES:
        return compute(sizes, strides, *kind[1:])
    key = (kind, sizes.shape, sizes.tobytes(), strides.tobytes())
    got = _MEMO.get(key)
    if got is None:
        if len(_MEMO) > 1 << 12:
            _MEMO.clear()
        got = _MEMO[key] = compute(sizes, strides, *kind[1:])
        for array in got if isinstance(got, tuple) else (got,):
            array.setflags(write=False)  # shared by every caller
    return got


def check_bounds(plan: ir.RankPlan, sources, path: str, writes=None) -> None:
    """Each write (default: all of the plan's): destination box non-empty, not self-overlapping and inside its
    parameter; every region non-negative; every source view inside its checkpoint tensor."""
    params = {p.name: p for p in plan.params}
    bad_geometries: dict[tuple, bool] = {}  # computed writes of one template share a few
    for w in plan.writes if writes is None else writes:
        param = params.get(w.param)
        if param is None:
            raise PlanBoundsError(
                f"{path}: rank {plan.rank} writes to {w.param}, which is not one of its params. " + advice(path)
            )
        d = w.dst
        geometry = (d.sizes, d.strides)
        if geometry not in bad_geometries:
            bad_geometries[geometry] = bool(bad_geometry([d.sizes], [d.strides], destination=True)[0])
        if d.offset < 0 or bad_geometries[geometry]:
            raise PlanBoundsError(
                f"{path}: rank {plan.rank}: destination box {d} of {w.param} is empty, negative or "
                f"self-overlapping (a stride 0 over more than one element). " + advice(path)
            )
        _inside(d, param, f"destination {w.param}", plan.rank, path)
        _check_view_bounds(w.src, sources, plan.rank, path, param.numel)


def _check_view_bounds(view: ir.View, sources, rank, path, max_numel: int) -> None:
    _non_negative(view.region, rank, path)
    if isinstance(view.leaf, ir.Source):
        meta = _lookup(sources, view.leaf.name)
        if meta is None:
            raise PlanBoundsError(
                f"{path}: rank {rank} reads {view.leaf.name}, which is not a checkpoint tensor of "
                f"this plan. " + advice(path)
            )
        _inside(view.region, meta, f"source {view.leaf.name}", rank, path)
    else:
        _check_leaf(view.leaf, sources, rank, path, max_numel)


def _check_leaf(leaf, sources, rank, path, max_numel: int) -> None:
    if isinstance(leaf, ir.Call):
        for v in leaf.inputs:
            _check_view_bounds(v, sources, rank, path, max_numel)
    elif isinstance(leaf, ir.Update):
        _non_negative(leaf.region, rank, path)
        _check_view_bounds(leaf.value, sources, rank, path, max_numel)
        if isinstance(leaf.base, ir.Source) and _lookup(sources, leaf.base.name) is None:
            raise PlanBoundsError(
                f"{path}: rank {rank} reads {leaf.base.name}, which is not a checkpoint tensor of "
                f"this plan. " + advice(path)
            )
        _check_leaf(leaf.base, sources, rank, path, max_numel)
    elif isinstance(leaf, ir.Full):
        numel = ir.Region(0, leaf.sizes, ()).numel
        if min(leaf.sizes, default=0) < 0 or numel > max_numel:
            raise PlanBoundsError(
                f"{path}: rank {rank}: constant fill of sizes {list(leaf.sizes)} is negative or "
                f"larger than the parameter it fills ({max_numel} elements). " + advice(path)
            )


def _non_negative(region: ir.Region, rank, path) -> None:
    if region.offset < 0 or min(region.sizes, default=0) < 0 or min(region.strides, default=0) < 0:
        raise PlanBoundsError(
            f"{path}: rank {rank}: region {region} has a negative offset, size or stride. " + advice(path)
        )


def _inside(region: ir.Region, meta: ir.TensorMeta, what: str, rank: int, path: str) -> None:
    message = (
        f"{path}: rank {rank}: box {region} lies outside {what} of shape {list(meta.shape)} "
        f"({meta.numel} elements). " + advice(path)
    )
    if len(region.sizes) != len(region.strides):
        raise PlanBoundsError(message)
    check_extents([region.offset], [0], [region.sizes], [region.strides], [meta.numel], lambda _: message)


def _overlapping(sizes, strides) -> np.ndarray:
    """Per row, whether the as_strided box may touch one element twice: dims of size > 1, sorted by stride, must each
    step past everything the smaller dims reach (how every view of a contiguous parameter is laid out)."""
    sizes, strides = np.asarray(sizes, dtype=np.float64), np.asarray(strides, dtype=np.float64)  # [rows, ndim]
    big = sizes > 1
    order = np.argsort(np.where(big, strides, np.inf), axis=1, kind="stable")
    s = np.take_along_axis(strides, order, 1)
    reach = np.take_along_axis(np.where(big, (sizes - 1) * strides, 0.0), order, 1).cumsum(axis=1)
    before = np.concatenate([np.zeros((len(s), 1)), reach[:, :-1]], axis=1)
    return (np.take_along_axis(big, order, 1) & (s <= before)).any(axis=1)


def _lookup(table, name):
    try:
        return table[name]
    except KeyError:
        return None
