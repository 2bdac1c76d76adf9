"""Compile per-rank recordings into a canonical, templated plan body.

Canonicalisation. The recorder already folds pure view chains into one `View(Source, Region)`; here we drop empty
writes, merge exact duplicates, and sort writes into a canonical order. Writes into a parameter whose destinations
overlap (last write wins in the real loader) keep their recording order instead: they go to the rank's `ordered` list.
Computed writes that only repeat elements of a checkpoint view (`repeat_interleave` chains: block-FP8 scale grids that
vLLM refines) become the pure-view writes they equal (plan/compile/simplify.py), so they template like every other view.

Templating. A Kimi-K2 rank has ~70k writes, but they are a few dozen *shapes* repeated over layers, experts and ranks.
Every write is flattened into a skeleton (its structure, with each integer replaced by a hole, and each digit group of
a dotted name replaced by `{}`) plus the vector of those integers. Writes with the same skeleton form a group; the
group's variables are (consumer rank, layer of the destination param or -1, the integers of its checkpoint names). Each
hole is fitted as an exact integer affine function of the variables. A hole that does not fit splits the group by that
hole's value (or by rank, when the rank takes fewer values), so templating is always exact: worst case, a group holds a
single write. The variable tuples of a group are stored as a compressed trie of ranges (`IndexSet`), rank first, so one
rank instantiates without touching the others.

Instantiating a rank of the body (plan/file/rank.py; tests/reference.py's `instantiate`, write by write) rebuilds
the rank's `ir.RankPlan`, equal to the direct recording (tests/integration/test_compile.py).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from shardplan.plan import ir
from shardplan.plan.body import Group, PlanBody, SourceTable, split_metas
from shardplan.plan.compile.simplify import compile_writes
from shardplan.plan.names import layer_of, with_layer
from shardplan.plan.rowkeys import distinct_rows
from shardplan.plan.template import build_trie, flatten_write, iter_trie, trie_from_rows, trie_node


# ---- affine fitting ---------------------------------------------------------------------------------------
def _fit(var_rows: np.ndarray, hole_rows: np.ndarray) -> tuple[np.ndarray | None, int]:
    """Exact integer affine fit of every hole column; returns (coeffs, -1) or (None, index of a failing hole)."""
    n, k = var_rows.shape
    design = np.concatenate([np.ones((n, 1), dtype=np.int64), var_rows], axis=1)
    # keep only columns that vary independently; the others get coefficient 0
    keep = [0]
    for j in range(1, k + 1):
        trial = keep + [j]
        if np.linalg.matrix_rank(design[:, trial].astype(np.float64)) == len(trial):
            keep.append(j)
    sub = design[:, keep].astype(np.float64)
    solution, *_ = np.linalg.lstsq(sub, hole_rows.astype(np.float64), rcond=None)
    coeffs_sub = np.rint(solution).astype(np.int64)
    coeffs = np.zeros((hole_rows.shape[1], k + 1), dtype=np.int64)
    coeffs[:, keep] = coeffs_sub.T
    predicted = design @ coeffs.T
    bad = np.nonzero((predicted != hole_rows).any(axis=0))[0]
    if len(bad):
        return None, int(bad[0])
    return coeffs, -1


def split_by_rank(num_ranks: int, num_hole_values: int) -> bool:
    """The rank-group split rule, when a hole does not fit one affine function: split the rows by rank when that
    makes fewer parts than splitting by the failing hole's value (pieces of a refined FP8 scale alternate between
    ranks, head block and tail block, while their offsets move with every expert). `_make_groups` and
    rankblocks.groups_of_blocks both split by it, so an extended layout templates as its full recording does."""
    return 1 < num_ranks < num_hole_values


def _make_groups(skeleton, var_rows: np.ndarray, hole_rows: np.ndarray, out: list[Group]) -> None:
    """Exact duplicates were removed per rank (and rank is a variable), so rows sharing variables differ in holes."""
    if len(distinct_rows(var_rows)[0]) < len(var_rows):
        # same variables, different holes (one source copied to several places): split by a differing hole
        column = next(c for c in range(hole_rows.shape[1]) if len(np.unique(hole_rows[:, c])) > 1)
        for value in np.unique(hole_rows[:, column]):
            mask = hole_rows[:, column] == value
            _make_groups(skeleton, var_rows[mask], hole_rows[mask], out)
        return
    if hole_rows.shape[1] == 0:
        coeffs = np.zeros((0, var_rows.shape[1] + 1), dtype=np.int64)
    else:
        coeffs, bad = _fit(var_rows, hole_rows)
        if coeffs is None:
            split = hole_rows[:, bad]
            if split_by_rank(len(np.unique(var_rows[:, 0])), len(np.unique(split))):
                split = var_rows[:, 0]
            for value in np.unique(split):
                mask = split == value
                _make_groups(skeleton, var_rows[mask], hole_rows[mask], out)
            return
    out.append(Group(skeleton, coeffs, trie_from_rows(var_rows), var_rows.shape[1]))  # rows are distinct here


def compile_plans(plans: Sequence[ir.RankPlan], sources: Sequence[ir.TensorMeta]) -> PlanBody:
    by_skeleton: dict[tuple, tuple[list, list]] = {}
    ordered: dict[int, list[ir.Write]] = {}
    for plan in plans:
        free, kept = compile_writes(plan.writes)
        if kept:
            ordered.setdefault(plan.rank, []).extend(kept)
        seen: set[ir.Write] = set()
        for w in free:
            if w in seen:
                continue
            seen.add(w)
            skel, holes, var_values = flatten_write(w)
            rows = by_skeleton.setdefault((skel, len(var_values)), ([], []))
            rows[0].append([plan.rank, layer_of(w.param)] + var_values)
            rows[1].append(holes)
    # only the order among writes to one param matters: a stable sort by param makes it canonical
    ordered = {r: sorted(ws, key=lambda w: w.param) for r, ws in ordered.items()}
    params, rank_metas = split_metas({p.rank: p.params for p in plans})
    return body_from_rows(
        by_skeleton,
        ordered,
        params,
        rank_metas=rank_metas,
        rank_params={p.rank: tuple(sorted(m.name for m in p.params)) for p in plans},
        fallbacks={p.rank: list(p.fallbacks) for p in plans if p.fallbacks},
        not_needed={p.rank: tuple(p.not_needed) for p in plans},
        sources=sources,
    )


def body_from_rows(
    by_skeleton: Mapping[tuple, tuple],
    ordered: dict[int, list[ir.Write]],
    params: Mapping[str, ir.TensorMeta],
    *,
    rank_params: dict[int, tuple[str, ...]],
    fallbacks: dict[int, list[ir.Fallback]],
    not_needed: dict[int, tuple[str, ...]],
    sources: Sequence[ir.TensorMeta] | SourceTable,
    rank_metas: dict[int, dict[str, ir.TensorMeta]] | None = None,
) -> PlanBody:
    """The templating half of compile_plans: `by_skeleton[(skeleton, num_name_vars)] = (var rows, hole rows)`, the
    var rows being [rank, layer, name ints...]. Row order does not matter. compile/extend.py feeds it rows it extended
    to unrecorded ranks, so both paths template through this one function."""
    groups: list[Group] = []
    for (skel, _), (var_rows, hole_rows) in sorted(by_skeleton.items(), key=lambda kv: repr(kv[0])):
        _make_groups(
            skel,
            np.asarray(var_rows, dtype=np.int64),
            np.asarray(hole_rows, dtype=np.int64).reshape(len(hole_rows), -1),
            groups,
        )
    return body_from_groups(
        groups,
        ordered,
        params,
        rank_params=rank_params,
        fallbacks=fallbacks,
        not_needed=not_needed,
        sources=sources,
        rank_metas=rank_metas,
    )


def body_from_groups(
    groups: list[Group],
    ordered: dict[int, list[ir.Write]],
    params: Mapping[str, ir.TensorMeta],
    *,
    rank_params: dict[int, tuple[str, ...]],
    fallbacks: dict[int, list[ir.Fallback]],
    not_needed: dict[int, tuple[str, ...]],
    sources: Sequence[ir.TensorMeta] | SourceTable,
    rank_metas: dict[int, dict[str, ir.TensorMeta]] | None = None,
) -> PlanBody:
    """The PlanBody of templated groups (body_from_rows' groups, or plan/compile/rankblocks.py's from rank classes)."""
    return PlanBody(
        ranks=tuple(sorted(rank_params)),
        sources=sources if isinstance(sources, SourceTable) else SourceTable.from_metas(sources),
        params=dict(sorted(params.items())),
        rank_params=rank_params,
        groups=groups,
        ordered=ordered,
        fallbacks=fallbacks,
        not_needed=not_needed,
        rank_metas=rank_metas or {},
    )


# ---- sampled recording: extend a few recorded layers to every layer of their class ---------------------------
def rename_layer(w: ir.Write, old: int, new: int) -> ir.Write:
    a, b = f"layers.{old}.", f"layers.{new}."

    def name(n: str) -> str:
        return n.replace(a, b) if n.startswith(a) or ("." + a) in n else n

    def leaf(x):
        if isinstance(x, ir.Source):
            return ir.Source(name(x.name))
        if isinstance(x, ir.Call):
            return ir.Call(x.op, x.args, x.kwargs, tuple(ir.View(leaf(v.leaf), v.region) for v in x.inputs), x.out)
        if isinstance(x, ir.Update):
            return ir.Update(leaf(x.base), x.region, ir.View(leaf(x.value.leaf), x.value.region))
        return x

    return ir.Write(name(w.param), w.dst, ir.View(leaf(w.src.leaf), w.src.region))


def check_layer_invariance(plans: Sequence[ir.RankPlan], classes: dict[int, list[int]]) -> str | None:
    """None when, on every rank, the writes of each sampled layer equal the class representative's, renamed.
    `classes` maps a representative (sampled) layer to the other sampled layers of its class."""
    for plan in plans:
        by_layer: dict[int, list[ir.Write]] = {}
        for w in plan.writes:
            if w.dst.numel:
                by_layer.setdefault(layer_of(w.param), []).append(w)
        for rep, others in classes.items():
            expected = by_layer.get(rep, [])
            for other in others:
                got = [rename_layer(w, other, rep) for w in by_layer.get(other, [])]
                if got != expected:
                    return f"rank {plan.rank}: layer {other} is not a renamed copy of layer {rep}"
        fallback_layers = {layer_of(f.source) for f in plan.fallbacks}
        if fallback_layers - {-1}:
            return f"rank {plan.rank}: fallbacks inside layers {sorted(fallback_layers - {-1})}"
    return None


def layer_split_templates(body: PlanBody, classes: dict[int, list[int]]) -> str | None:
    """None when every group holding a class representative's rows also holds its other sampled layers' rows; else
    a note naming one that does not. `_make_groups` splits rows that share their variables (one source written to
    several places of one param) by the first hole that varies, which can be the layer digits of the names: each
    group then holds one layer, its fit cannot see the layer (a constant), and `extend_layers` would copy the
    representative's writes to every layer of its class under the representative's own names."""
    for g in body.groups:
        layers = {layer for _, _, _, child in g.index for s, e, st, _ in child for layer in range(s, e, st)}
        for rep, others in classes.items():
            if rep in layers and others and not layers & set(others):
                return f"template {g.skeleton[1][1]!r} holds layer {rep} without layer {others[0]}"
    return None


def extend_layers(
    body: PlanBody, full_layers: dict[int, list[int]], drop: set[int], sources: Sequence[ir.TensorMeta]
) -> PlanBody:
    """`full_layers[rep]`: every layer of rep's class (rep included); layers in `drop` were sampled only to check
    invariance. Rebuilds each group's index over all layers; the result equals compiling every layer directly."""
    groups: list[Group] = []
    for g in body.groups:
        index = _extend_layer_index(g.index, full_layers, drop)
        if index is not None:
            groups.append(Group(g.skeleton, g.coeffs, index, g.num_vars))
    params: dict[str, ir.TensorMeta] = {}
    rank_params: dict[int, tuple[str, ...]] = {}
    extended: dict[tuple[str, ...], tuple[str, ...]] = {}  # ranks of a layout mostly share their param names
    for rank, names in body.rank_params.items():
        if names in extended:
            rank_params[rank] = extended[names]
            continue
        out = set()
        for n in names:
            meta = body.params[n]
            for renamed in _layer_copies(n, full_layers, drop):
                params[renamed] = ir.TensorMeta(renamed, meta.shape, meta.dtype)
                out.add(renamed)
        rank_params[rank] = extended[names] = tuple(sorted(out))
    ordered = {}
    for rank, writes in body.ordered.items():
        out_writes = []
        for w in writes:
            layer = layer_of(w.param)
            if layer in drop:
                continue
            for new in full_layers.get(layer, [layer]) if layer >= 0 else [layer]:
                out_writes.append(rename_layer(w, layer, new) if layer >= 0 else w)
        ordered[rank] = sorted(out_writes, key=lambda w: w.param)
    rank_metas = {}
    for rank, overrides in body.rank_metas.items():
        out_metas = {
            renamed: ir.TensorMeta(renamed, meta.shape, meta.dtype)
            for n, meta in overrides.items()
            for renamed in _layer_copies(n, full_layers, drop)
        }
        if out_metas:
            rank_metas[rank] = out_metas
    return PlanBody(
        ranks=body.ranks,
        sources=SourceTable.from_metas(sources),
        params=dict(sorted(params.items())),
        rank_params=rank_params,
        groups=groups,
        ordered=ordered,
        fallbacks=body.fallbacks,
        not_needed={},
        rank_metas=rank_metas,
    )


def _layer_copies(name: str, full_layers: dict[int, list[int]], drop: set[int]) -> list[str]:
    """`name` renamed to every layer of its layer's class (itself outside the layers; none for a dropped layer)."""
    layer = layer_of(name)
    if layer < 0:
        return [name]
    if layer in drop:
        return []
    return [with_layer(name, layer, new) for new in full_layers.get(layer, [layer])]


def _extend_layer_index(index, full_layers: dict[int, list[int]], drop: set[int]):
    """The trie build_trie would make of the index's rows with each layer (variable 1) replaced by every layer of its
    class, built from the trie itself: the subtrees under a layer are shared, not expanded (a non-EP Kimi-K2 body has
    ~2M rows over 32 ranks x 61 layers)."""
    new_children: dict[int, tuple | None] = {}
    pairs = []
    for start, stop, step, child in index:  # the rank variable
        if id(child) not in new_children:
            by_layer: dict[int, object] = {}
            for s, e, st, sub in child:
                for layer in range(s, e, st):
                    if layer in drop:
                        continue
                    for new in full_layers.get(layer, [layer]):
                        if by_layer.setdefault(new, sub) != sub:  # two layers' rows land on one: build_trie unites
                            return build_trie(
                                sorted(
                                    {
                                        (t[0], n) + t[2:]
                                        for t in iter_trie(index)
                                        if t[1] not in drop
                                        for n in full_layers.get(t[1], [t[1]])
                                    }
                                )
                            )
            new_children[id(child)] = _runs(sorted(by_layer.items(), key=lambda p: p[0])) if by_layer else None
        if new_children[id(child)] is not None:
            pairs.extend((rank, new_children[id(child)]) for rank in range(start, stop, step))
    return _runs(pairs) if pairs else None


def _runs(pairs) -> tuple:
    return trie_node(pairs)
