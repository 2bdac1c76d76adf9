"""Extend a few recorded ranks to every rank of a layout, at template level.

`compile_plans` turns each write into a skeleton and integers: a row [rank, layer, name ints | holes] under the key
(skeleton, number of name ints). Ranks of one layout differ by affine offsets in those integers almost everywhere: the
TP rank moves a narrow's offset, the EP rank moves the expert indices a rank reads. A *rank class* (chosen from the
layout by record/ranks.py) is a set of ranks whose rows, sorted, are an exact integer-affine function of one
coordinate u (the TP rank, or the EP rank).

`FlatRank` is one recorded rank without its rank column: every template's rows, sorted and unique; the ordered
(overlapping-destination) writes as skeletons + integers; the parameter names and shapes as text + integers; the
fallbacks. `Line` is the affine function through two recorded ranks: every integer of the second minus the first must
be divisible by their coordinate distance, and the two must have the same templates, the same number of rows in each,
the same ordered-write skeletons, parameters and fallbacks; otherwise there is no line. `Line.at(u)` predicts a rank;
record/ranks.py accepts a line only after a third recorded rank equals its prediction exactly, and records more ranks
otherwise. A predicted rank is kept as `Predicted` (its line and coordinate, its rows not made): `body_from_flat` builds
the plan body of every rank from recorded FlatRanks and predictions, templating the ranks of one line as one block per
template (plan/compile/rankblocks.py: the groups `compile_plans` makes of all rows, without N copies of them), so a
correct prediction gives the same bytes as recording every rank, at a cost that does not grow with the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from shardplan.plan import ir
from shardplan.plan.body import Group, PlanBody, SourceTable, split_metas
from shardplan.plan.compile.compiler import body_from_groups
from shardplan.plan.compile.rankblocks import Block, groups_of_blocks, line_block, literal
from shardplan.plan.compile.simplify import compile_writes
from shardplan.plan.names import layer_of
from shardplan.plan.template import Filler, flatten_write, split_name, unflatten_write


class NotAffine(Exception):
    """Two ranks' plans are not related by an integer-affine map (the caller records more ranks)."""


@dataclass(frozen=True, eq=False)
class FlatRank:
    """One rank's plan as the compiler sees it, without the rank column (so ranks compare and interpolate)."""

    rows: dict[
        tuple, np.ndarray
    ]  # (skeleton, num name ints) -> int64 [n, 1 + num name ints + num holes]; sorted, unique
    ordered: tuple  # skeletons of the ordered writes, in plan order
    ordered_ints: np.ndarray  # their holes, concatenated
    ordered_counts: tuple  # number of holes of each
    params: tuple  # (name text, ndim, dtype) of each param, in plan order
    param_ints: np.ndarray  # their name ints and shapes, concatenated
    fallbacks: tuple

    def same_as(self, other: "FlatRank") -> str | None:
        """None when equal; else what differs first (for the recording note)."""
        if self.rows.keys() != other.rows.keys():
            return "different write templates"
        for key, rows in self.rows.items():
            if not np.array_equal(rows, other.rows[key]):
                return f"different rows of template {_short(key)}"
        if (self.ordered, self.ordered_counts, self.params, self.fallbacks) != (
            other.ordered,
            other.ordered_counts,
            other.params,
            other.fallbacks,
        ):
            return "different ordered writes, params or fallbacks"
        if not np.array_equal(self.ordered_ints, other.ordered_ints) or not np.array_equal(
            self.param_ints, other.param_ints
        ):
            return "different ordered writes or param shapes"
        return None


def _short(key) -> str:
    text = repr(key[0])
    return text if len(text) < 80 else text[:77] + "..."


def _ints(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def flat_rank(plan: ir.RankPlan) -> FlatRank:
    free, ordered = compile_writes(plan.writes)  # as compile_plans splits and rewrites them
    rows: dict[tuple, list] = {}
    for w in free:
        skel, holes, var_values = flatten_write(w)
        rows.setdefault((skel, len(var_values)), []).append([layer_of(w.param)] + var_values + holes)
    # compile_plans drops exact duplicates and keeps the recording order of ordered writes within a param
    arrays = {k: np.unique(_ints(v).reshape(len(v), -1), axis=0) for k, v in rows.items()}
    skeletons, ordered_ints, counts = [], [], []
    for w in sorted(ordered, key=lambda w: w.param):
        skel, holes, _ = flatten_write(w)
        skeletons.append(skel)
        ordered_ints.extend(holes)
        counts.append(len(holes))
    params, param_ints = [], []
    for p in plan.params:
        params.append((split_name(p.name, param_ints), len(p.shape), p.dtype))
        param_ints.extend(p.shape)
    return FlatRank(
        arrays,
        tuple(skeletons),
        _ints(ordered_ints),
        tuple(counts),
        tuple(params),
        _ints(param_ints),
        tuple(plan.fallbacks),
    )


class Line:
    """The integer-affine map u -> FlatRank (u a tuple of coordinates) through rank a at u_a and, for each axis, one
    rank that differs from a on that axis only; NotAffine if there is none."""

    def __init__(self, a: FlatRank, u_a, others):
        self.base, self.u_a = a, tuple(u_a)
        self.axes = []  # (axis, row slopes by template, ordered-write slope, param slope)
        for b, u_b in others:
            moved = [i for i, (x, y) in enumerate(zip(self.u_a, u_b)) if x != y]
            if len(moved) != 1:
                raise NotAffine("two ranks that differ on more or less than one coordinate")
            axis = moved[0]
            span = u_b[axis] - self.u_a[axis]
            if a.rows.keys() != b.rows.keys():
                raise NotAffine("different write templates")
            if (a.ordered, a.ordered_counts, a.params, a.fallbacks) != (
                b.ordered,
                b.ordered_counts,
                b.params,
                b.fallbacks,
            ):
                raise NotAffine("different ordered writes, params or fallbacks")
            self.axes.append(
                (
                    axis,
                    {k: _slope(rows, b.rows[k], span, _short(k)) for k, rows in a.rows.items()},
                    _slope(a.ordered_ints, b.ordered_ints, span, "ordered writes"),
                    _slope(a.param_ints, b.param_ints, span, "params"),
                )
            )

    def at(self, u) -> FlatRank:
        rows = dict(self.base.rows)
        for axis, slopes, _, _ in self.axes:
            k = u[axis] - self.u_a[axis]
            if k:
                rows = {key: r + k * slopes[key] for key, r in rows.items()}
        return self._flat(rows, u)

    def predict(self, u) -> "Predicted":
        """Rank u's plan without its rows: body_from_flat makes the rank level of the templates from the line."""
        return Predicted(self, tuple(u), self._flat({}, u))

    def offsets(self, u) -> list[int]:
        """u minus the base rank's coordinate, per axis (in self.axes order)."""
        return [u[axis] - self.u_a[axis] for axis, _, _, _ in self.axes]

    def _flat(self, rows: dict, u) -> FlatRank:
        a = self.base
        ordered_ints, param_ints = a.ordered_ints, a.param_ints
        for axis, _, ordered_slope, param_slope in self.axes:
            k = u[axis] - self.u_a[axis]
            if k:
                ordered_ints = ordered_ints + k * ordered_slope
                param_ints = param_ints + k * param_slope
        return FlatRank(rows, a.ordered, ordered_ints, a.ordered_counts, a.params, param_ints, a.fallbacks)


@dataclass(frozen=True, eq=False)
class Predicted:
    """A rank predicted on a line, its rows not made: `rest` is its plan without rows (ordered writes, params,
    fallbacks); `flat()` makes the rows too (to check a prediction against a recording)."""

    line: Line
    u: tuple
    rest: FlatRank

    def flat(self) -> FlatRank:
        return self.line.at(self.u)


def as_flat(f: FlatRank | Predicted) -> FlatRank:
    return f.flat() if isinstance(f, Predicted) else f


def _slope(a: np.ndarray, b: np.ndarray, span: int, what: str) -> np.ndarray:
    if a.shape != b.shape:
        raise NotAffine(f"different number of rows in {what}")
    diff = b - a
    if (diff % span).any():
        raise NotAffine(f"{what}: offsets not divisible by the rank distance")
    return diff // span


def sorted_rows(f: FlatRank | Predicted) -> FlatRank:
    """A prediction with its rows sorted and unique, as flat_rank makes a recording (to compare the two)."""
    f = as_flat(f)
    return FlatRank(
        {k: np.unique(v, axis=0) for k, v in f.rows.items()},
        f.ordered,
        f.ordered_ints,
        f.ordered_counts,
        f.params,
        f.param_ints,
        f.fallbacks,
    )


def body_from_flat(
    flats: Mapping[int, FlatRank | Predicted], sources: Sequence[ir.TensorMeta] | SourceTable
) -> PlanBody:
    """The plan body of every rank in `flats` (recorded or predicted), templated exactly as compile_plans does.
    The rows of the ranks predicted on one line are one block per template (plan/compile/rankblocks.py), not N
    copies."""
    blocks: dict[tuple, list[Block]] = {}
    on_line: dict[int, tuple[Line, list[int], list[list[int]]]] = {}  # id(line) -> (line, ranks, offsets)
    ordered: dict[int, list[ir.Write]] = {}
    rank_metas_of: dict[int, list[ir.TensorMeta]] = {}
    rank_params: dict[int, tuple[str, ...]] = {}
    fallbacks: dict[int, list[ir.Fallback]] = {}
    metas: dict[tuple, list[ir.TensorMeta]] = {}
    names: dict[tuple, tuple[str, ...]] = {}
    for rank in sorted(flats):
        f = flats[rank]
        if isinstance(f, Predicted):
            line, ranks, offsets = on_line.setdefault(id(f.line), (f.line, [], []))
            ranks.append(rank)
            offsets.append(line.offsets(f.u))
            f = f.rest
        for key, rows in f.rows.items():
            blocks.setdefault(key, []).append(literal(rank, rows, 1 + key[1]))
        if f.ordered:
            writes, pos = [], 0
            for skel, count in zip(f.ordered, f.ordered_counts):
                writes.append(unflatten_write(skel, f.ordered_ints[pos : pos + count].tolist()))
                pos += count
            ordered[rank] = writes
        key = (f.params, f.param_ints.tobytes())
        if key not in metas:  # ranks of a layout mostly share their params
            filler = Filler(f.param_ints.tolist())
            metas[key] = []
            for text, ndim, dtype in f.params:
                name = filler.name(text)
                metas[key].append(ir.TensorMeta(name, tuple(filler.take() for _ in range(ndim)), dtype))
            names[key] = tuple(sorted(m.name for m in metas[key]))
        rank_metas_of[rank] = metas[key]
        rank_params[rank] = names[key]
        if f.fallbacks:
            fallbacks[rank] = list(f.fallbacks)
    for line, ranks, offsets in on_line.values():
        for key, base in line.base.rows.items():
            slopes = np.stack([axis_slopes[key] for _, axis_slopes, _, _ in line.axes])
            blocks.setdefault(key, []).extend(line_block(ranks, offsets, base, slopes, 1 + key[1]))
    groups: list[Group] = []
    for (skel, num_name_vars), key_blocks in sorted(blocks.items(), key=lambda kv: repr(kv[0])):
        groups_of_blocks(skel, key_blocks, 1 + num_name_vars, groups)
    params, rank_metas = split_metas(rank_metas_of)
    return body_from_groups(
        groups,
        ordered,
        params,
        rank_params=rank_params,
        fallbacks=fallbacks,
        not_needed={},
        sources=sources,
        rank_metas=rank_metas,
    )
