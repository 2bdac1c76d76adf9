"""Checks made when a rank of a plan is instantiated: every destination box non-empty, never touching an element
twice and inside a param of that rank; every region non-negative; every checkpoint view inside its declared tensor
(docs/plan-format.md, "Box rules"). Pure-view templates are checked vectorised, over all their writes at once."""

from __future__ import annotations

from typing import Callable

import numpy as np

from shardplan.plan import ir
from shardplan.plan.file.errors import PlanBoundsError, advice


def check_extents(lo, hi, empty, numel, message: Callable[[int], str]) -> None:
    """The box rule every bounds check ends in: a non-empty box's element extent [lo, hi) lies inside [0, numel) of
    its tensor (arrays, one entry per box). Raises PlanBoundsError with `message(i)` for the first box i that does
    not: at load (`_inside` here) and at replay (runtime/replay.py's sources, runtime/apply.py's params) alike."""
    lo, hi, numel = np.asarray(lo), np.asarray(hi), np.asarray(numel)
    bad = ~np.asarray(empty, dtype=bool) & ((lo < 0) | (hi > numel))
    if bad.any():
        raise PlanBoundsError(message(int(np.nonzero(bad)[0][0])))


def check_bounds(plan: ir.RankPlan, sources, path: str, writes=None) -> None:
    """Each write (default: all of the plan's): destination box non-empty, not self-overlapping and inside its
    parameter; every region non-negative; every source view inside its checkpoint tensor."""
    params = {p.name: p for p in plan.params}
    overlapping: dict[tuple, bool] = {}  # per geometry: computed writes of one template share a few
    for w in plan.writes if writes is None else writes:
        param = params.get(w.param)
        if param is None:
            raise PlanBoundsError(
                f"{path}: rank {plan.rank} writes to {w.param}, which is not one of its params. " + advice(path)
            )
        d = w.dst
        geometry = (d.sizes, d.strides)
        if geometry not in overlapping:
            overlapping[geometry] = bool(_overlapping([d.sizes], [d.strides])[0])
        bad = d.offset < 0 or min(d.sizes, default=1) < 1 or min(d.strides, default=0) < 0 or overlapping[geometry]
        if bad:
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
    lo, hi = region.extent()
    message = (
        f"{path}: rank {rank}: box {region} lies outside {what} of shape {list(meta.shape)} "
        f"({meta.numel} elements). " + advice(path)
    )
    if len(region.sizes) != len(region.strides):
        raise PlanBoundsError(message)
    check_extents([lo], [hi], [False], [meta.numel], lambda _: message)


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
