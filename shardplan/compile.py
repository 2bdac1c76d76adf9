"""Compile per-rank recordings into a canonical, templated plan body.

Canonicalisation. The recorder already folds pure view chains into one `View(Source, Region)`; here we drop empty
writes, merge exact duplicates, and sort writes into a canonical order. Writes into a parameter whose destinations
overlap (last write wins in the real loader) keep their recording order instead: they go to the rank's `ordered` list.

Templating. A Kimi-K2 rank has ~70k writes, but they are a few dozen *shapes* repeated over layers, experts and ranks.
Every write is flattened into a skeleton (its structure, with each integer replaced by a hole, and each digit group of
a dotted name replaced by `{}`) plus the vector of those integers. Writes with the same skeleton form a group; the
group's variables are (consumer rank, layer of the destination param or -1, the integers of its checkpoint names). Each hole is
fitted as an exact integer affine function of the variables. A hole that does not fit splits the group by that hole's
value, so templating is always exact: worst case, a group holds a single write. The variable tuples of a group are
stored as a compressed trie of ranges (`IndexSet`), rank first, so one rank instantiates without touching the others.

`instantiate(body, rank)` rebuilds the rank's `ir.RankPlan`, equal to the direct recording (tests/test_compile.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from . import ir

_DIGITS = re.compile(r"(?<=\.)\d+(?=\.|$)")

# ---- flatten / unflatten: IR <-> (skeleton, ints) ---------------------------------------------------------
# A skeleton is a nested tuple of tags, strings, floats, bools and HOLE markers; it is hashable and msgpack-able.
HOLE = "\x00#"


def _split_name(name: str, ints: list[int]) -> str:
    def repl(m):
        ints.append(int(m.group(0)))
        return "{}"
    return _DIGITS.sub(repl, name.replace("{", "{{").replace("}", "}}"))


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_LAYER_TEXT = re.compile(r"(?:^|\.)layers\.\{\}\.")


def _layer_hole(text: str) -> int | None:
    """Index, among a name template's holes, of its layer index (`layers.{}.`), None when it has none."""
    m = _LAYER_TEXT.search(text)
    return text[:m.start()].count("{}") if m else None


def layer_of(name: str) -> int:
    """Decoder layer index in a dotted name (`model.layers.7.x` -> 7), -1 when the name is not in a layer."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def flatten_write(w: ir.Write) -> tuple[tuple, list[int], list[int]]:
    """-> (skeleton, holes, vars). vars = the integers of the checkpoint names the write reads, in order."""
    holes: list[int] = []
    var_values: list[int] = []
    skel = ("W", _name(w.param, holes), _region(w.dst, holes), _view(w.src, holes, var_values))
    return skel, holes, var_values


def _name(name: str, holes: list[int]) -> tuple:
    return ("n", _split_name(name, holes))


def _ints(values: Iterable[int], holes: list[int]) -> tuple:
    out = []
    for v in values:
        holes.append(int(v))
        out.append(HOLE)
    return tuple(out)


def _region(r: ir.Region, holes: list[int]) -> tuple:
    return ("r", _ints((r.offset,), holes), _ints(r.sizes, holes), _ints(r.strides, holes))


def _view(v: ir.View, holes: list[int], var_values: list[int]) -> tuple:
    return ("v", _leaf(v.leaf, holes, var_values), _region(v.region, holes))


def _leaf(leaf: ir.Leaf, holes: list[int], var_values: list[int]) -> tuple:
    if isinstance(leaf, ir.Source):
        before = len(holes)
        text = _split_name(leaf.name, holes)
        # the source's layer index is not a variable of its own: it is fitted on the param's layer (variable 1),
        # which keeps index tries from repeating one subtree per layer
        skip = _layer_hole(text)
        var_values.extend(v for i, v in enumerate(holes[before:]) if i != skip)
        return ("S", text)
    if isinstance(leaf, ir.Full):
        value = leaf.value
        return ("F", ("f", float(value)) if isinstance(value, float) else value, _ints(leaf.sizes, holes), leaf.dtype)
    if isinstance(leaf, ir.Call):
        return ("C", leaf.op, tuple(_lit(a, holes) for a in leaf.args),
                tuple((k, _lit(v, holes)) for k, v in leaf.kwargs),
                tuple(_view(v, holes, var_values) for v in leaf.inputs), leaf.out)
    if isinstance(leaf, ir.Update):
        return ("U", _leaf(leaf.base, holes, var_values), _region(leaf.region, holes),
                _view(leaf.value, holes, var_values))
    raise TypeError(leaf)


def _lit(a, holes: list[int]):
    if isinstance(a, bool) or a is None or isinstance(a, str):
        return a
    if isinstance(a, int):
        holes.append(a)
        return HOLE
    if isinstance(a, float):
        return ("f", a)
    if isinstance(a, ir.Arg):
        return ("a", a.index)
    if isinstance(a, ir.DType):
        return ("d", a.name)
    if isinstance(a, ir.Slice):
        return ("s", _lit(a.start, holes), _lit(a.stop, holes), _lit(a.step, holes))
    if isinstance(a, ir.Const):
        return ("k", a.dtype, tuple(a.shape), tuple(a.values))
    if a is Ellipsis:
        return ("e",)
    if isinstance(a, tuple):
        return ("t",) + tuple(_lit(x, holes) for x in a)
    raise TypeError(f"cannot flatten literal {a!r}")


class _Filler:
    """Rebuilds IR from a skeleton and its hole values (in flatten order)."""

    def __init__(self, holes: Sequence[int]):
        self.holes, self.pos = holes, 0

    def take(self) -> int:
        v = self.holes[self.pos]
        self.pos += 1
        return int(v)

    def name(self, text: str) -> str:
        parts = text.split("{}")
        if len(parts) == 1:
            return text.replace("{{", "{").replace("}}", "}")
        out = [parts[0]]
        for p in parts[1:]:
            out.append(str(self.take()))
            out.append(p)
        return "".join(out).replace("{{", "{").replace("}}", "}")

    def ints(self, t: tuple) -> tuple[int, ...]:
        return tuple(self.take() for _ in t)

    def region(self, s) -> ir.Region:
        return ir.Region(self.ints(s[1])[0], self.ints(s[2]), self.ints(s[3]))

    def view(self, s) -> ir.View:
        return ir.View(self.leaf(s[1]), self.region(s[2]))

    def leaf(self, s) -> ir.Leaf:
        tag = s[0]
        if tag == "S":
            return ir.Source(self.name(s[1]))
        if tag == "F":
            value = s[1][1] if isinstance(s[1], tuple) else s[1]
            return ir.Full(value, self.ints(s[2]), s[3])
        if tag == "C":
            return ir.Call(s[1], tuple(self.lit(a) for a in s[2]), tuple((k, self.lit(v)) for k, v in s[3]),
                           tuple(self.view(v) for v in s[4]), s[5])
        if tag == "U":
            return ir.Update(self.leaf(s[1]), self.region(s[2]), self.view(s[3]))
        raise ValueError(f"unknown leaf tag {tag!r}")

    def lit(self, a):
        if a == HOLE:
            return self.take()
        if not isinstance(a, tuple):
            return a
        tag = a[0]
        if tag == "f":
            return a[1]
        if tag == "a":
            return ir.Arg(a[1])
        if tag == "d":
            return ir.DType(a[1])
        if tag == "s":
            return ir.Slice(self.lit(a[1]), self.lit(a[2]), self.lit(a[3]))
        if tag == "k":
            return ir.Const(a[1], tuple(a[2]), tuple(a[3]))
        if tag == "e":
            return Ellipsis
        if tag == "t":
            return tuple(self.lit(x) for x in a[1:])
        raise ValueError(f"unknown literal tag {tag!r}")

    def write(self, s) -> ir.Write:
        return ir.Write(self.name(s[1][1]), self.region(s[2]), self.view(s[3]))


def pure_view_layout(skel: tuple):
    """For the common skeleton `param[box] <- source[box]`: (param text, #param holes, dst ndim, source text,
    #source holes, src ndim); None for any other skeleton."""
    try:
        tag, (n, ptext), (r1, off1, sizes1, strides1), (v, (s_tag, stext), (r2, off2, sizes2, strides2)) = skel
    except (TypeError, ValueError):
        return None
    if (tag, n, r1, v, s_tag, r2) != ("W", "n", "r", "v", "S", "r"):
        return None
    return ptext, ptext.count("{}"), len(sizes1), stext, stext.count("{}"), len(sizes2)


def _pure_view_writes(layout, holes: np.ndarray) -> list[ir.Write]:
    """Builds writes straight from hole rows (the generic _Filler costs ~10x more; a non-EP Kimi-K2 rank has 70k).
    Names and regions repeat across layers and experts: they are built once and shared (records are immutable)."""
    ptext, kp, nd, stext, ks, ns = layout
    cache: dict = {}
    out = []
    Write, View, Region, Source = ir.Write, ir.View, ir.Region, ir.Source
    d0, d1 = kp, kp + 1 + 2 * nd
    s0 = d1 + ks
    s1 = s0 + 1 + 2 * ns
    for row in holes.tolist():
        pkey = ("p",) + tuple(row[:d0])
        pname = cache.get(pkey)
        if pname is None:
            pname = cache[pkey] = ptext.format(*row[:d0])
        dkey = tuple(row[d0:d1])
        dst = cache.get(dkey)
        if dst is None:
            dst = cache[dkey] = Region(row[d0], dkey[1:1 + nd], dkey[1 + nd:])
        skey = ("s",) + tuple(row[d1:s0])
        source = cache.get(skey)
        if source is None:
            source = cache[skey] = Source(stext.format(*row[d1:s0]))
        rkey = ("r",) + tuple(row[s0:s1])
        src = cache.get(rkey)
        if src is None:
            src = cache[rkey] = Region(row[s0], rkey[2:2 + ns], rkey[2 + ns:])
        out.append(Write(pname, dst, View(source, src)))
    return out


def unflatten_write(skel: tuple, holes: Sequence[int]) -> ir.Write:
    return _Filler(holes).write(skel)


# ---- index sets: compressed tries of ranges ---------------------------------------------------------------
# A trie node is a tuple of (start, stop, step, child) runs; child is None at the last variable. Equal children of
# consecutive values merge into one arithmetic run, so product-like sets (all layers x these experts) stay tiny.

def build_trie(tuples: Sequence[tuple[int, ...]], depth: int = 0):
    if not tuples or len(tuples[0]) == depth:
        return None
    by_value: dict[int, list] = {}
    for t in tuples:
        by_value.setdefault(t[depth], []).append(t)
    runs: list[list] = []  # [start, last, step (0: single value so far), child]
    for value in sorted(by_value):
        child = build_trie(by_value[value], depth + 1)
        if runs and runs[-1][3] == child:
            start, last, step, _ = runs[-1]
            if step == 0:
                runs[-1] = [start, value, value - start, child]
                continue
            if value - last == step:
                runs[-1][1] = value
                continue
        runs.append([value, value, 0, child])
    return tuple((start, last + (step or 1), step or 1, child) for start, last, step, child in runs)


def iter_trie(node, prefix=()) -> Iterable[tuple[int, ...]]:
    if node is None:
        yield prefix
        return
    for start, stop, step, child in node:
        for value in range(start, stop, step):
            yield from iter_trie(child, prefix + (value,))


def trie_child(node, value: int):
    """The sub-trie under first variable == value (None if absent; () when value is the last variable)."""
    for start, stop, step, child in node or ():
        if start <= value < stop and (value - start) % step == 0:
            return child if child is not None else ()
    return None


# ---- affine fitting ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    skeleton: tuple
    coeffs: np.ndarray   # int64 [num_holes, 1 + num_vars]: hole = coeffs[:, 0] + coeffs[:, 1:] @ vars
    index: tuple         # trie over var tuples (rank first)
    num_vars: int

    def instances(self, rank: int | None = None) -> np.ndarray:
        if rank is None:
            tuples = list(iter_trie(self.index))
        else:
            child = trie_child(self.index, rank)
            if child is None:
                return np.zeros((0, self.num_vars), dtype=np.int64)
            tuples = [(rank,) + t for t in iter_trie(child if child != () else None)]
        return np.asarray(tuples, dtype=np.int64).reshape(len(tuples), self.num_vars)

    def holes(self, rank: int | None = None) -> np.ndarray:
        var_rows = self.instances(rank)
        return self.coeffs[:, :1].T + var_rows @ self.coeffs[:, 1:].T

    def writes(self, rank: int | None = None) -> list[ir.Write]:
        holes = self.holes(rank)
        if len(holes) == 0:
            return []
        layout = pure_view_layout(self.skeleton)
        if layout is not None:
            return _pure_view_writes(layout, holes)
        return [unflatten_write(self.skeleton, row) for row in holes.tolist()]


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


def _make_groups(skeleton, var_rows: np.ndarray, hole_rows: np.ndarray, out: list[Group]) -> None:
    """Exact duplicates were removed per rank (and rank is a variable), so rows sharing variables differ in holes."""
    if len(np.unique(var_rows, axis=0)) < len(var_rows):
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
            for value in np.unique(hole_rows[:, bad]):
                mask = hole_rows[:, bad] == value
                _make_groups(skeleton, var_rows[mask], hole_rows[mask], out)
            return
    tuples = sorted(map(tuple, var_rows.tolist()))
    out.append(Group(skeleton, coeffs, build_trie(tuples), var_rows.shape[1]))


# ---- the checkpoint tensor table, templated like writes -----------------------------------------------------
class SourceTable(Mapping):
    """name -> TensorMeta for ~70k checkpoint tensors, stored as (name template, shape, dtype, index trie) rows.
    Lookups go through the template; iterating materialises names (sorted) once, on demand."""

    def __init__(self, templates: Sequence[tuple]):
        self.templates = sorted((str(t), tuple(s), str(d), i) for t, s, d, i in templates)
        self._by_text: dict[str, list] = {}
        for text, shape, dtype, index in self.templates:
            self._by_text.setdefault(text, []).append((shape, dtype, index))
        self._names: list[str] | None = None

    @classmethod
    def from_metas(cls, metas: Iterable[ir.TensorMeta]) -> "SourceTable":
        rows: dict[tuple, list] = {}
        for m in metas:
            ints: list[int] = []
            text = _split_name(m.name, ints)
            rows.setdefault((text, tuple(m.shape), m.dtype), []).append(tuple(ints))
        return cls([(t, s, d, build_trie(sorted(set(v)))) for (t, s, d), v in rows.items()])

    def __getitem__(self, name: str) -> ir.TensorMeta:
        ints: list[int] = []
        text = _split_name(name, ints)
        for shape, dtype, index in self._by_text.get(text, ()):
            if (index is None and not ints) or (index is not None and _trie_has(index, ints)):
                return ir.TensorMeta(name, shape, dtype)
        raise KeyError(name)

    def _materialise(self) -> list[str]:
        if self._names is None:
            names = []
            for text, _, _, index in self.templates:
                if index is None:
                    names.append(_Filler(()).name(text))
                else:
                    names.extend(_Filler(t).name(text) for t in iter_trie(index))
            self._names = sorted(names)
        return self._names

    def __iter__(self):
        return iter(self._materialise())

    def __len__(self) -> int:
        return sum(1 if index is None else sum(1 for _ in iter_trie(index)) for _, _, _, index in self.templates)


def _trie_has(node, values: Sequence[int]) -> bool:
    for v in values:
        node = trie_child(node, v)
        if node is None:
            return False
        node = node if node != () else None
    return node is None


# ---- the plan body --------------------------------------------------------------------------------------
@dataclass
class PlanBody:
    """Everything a plan file holds after its header: decoded but still templated."""
    ranks: tuple[int, ...]
    sources: "SourceTable"
    params: dict[str, ir.TensorMeta]        # union over ranks (param metadata is rank independent in vLLM)
    rank_params: dict[int, tuple[str, ...]]
    groups: list[Group]
    ordered: dict[int, list[ir.Write]]      # per rank, recording order (overlapping destinations)
    fallbacks: dict[int, list[ir.Fallback]]
    not_needed: dict[int, tuple[str, ...]]

    def num_writes(self, rank: int | None = None) -> int:
        total = sum(len(g.instances(rank)) for g in self.groups)
        ranks = self.ranks if rank is None else (rank,)
        return total + sum(len(self.ordered.get(r, ())) for r in ranks)


def _overlapping_params(writes: Sequence[ir.Write]) -> set[str]:
    spans: dict[str, list[tuple[int, int]]] = {}
    for w in writes:
        spans.setdefault(w.param, []).append(w.dst.extent())
    out = set()
    for param, s in spans.items():
        s.sort()
        for (lo0, hi0), (lo1, hi1) in zip(s, s[1:]):
            if lo1 < hi0:
                out.add(param)
                break
    return out


def compile_plans(plans: Sequence[ir.RankPlan], sources: Sequence[ir.TensorMeta]) -> PlanBody:
    by_skeleton: dict[tuple, tuple[list, list]] = {}
    ordered: dict[int, list[ir.Write]] = {}
    params: dict[str, ir.TensorMeta] = {}
    for plan in plans:
        for p in plan.params:
            params.setdefault(p.name, p)
        writes = [w for w in plan.writes if w.dst.numel > 0]
        overlapping = _overlapping_params(writes)
        seen: set[ir.Write] = set()
        for w in writes:
            if w.param in overlapping:
                ordered.setdefault(plan.rank, []).append(w)
                continue
            if w in seen:
                continue
            seen.add(w)
            skel, holes, var_values = flatten_write(w)
            rows = by_skeleton.setdefault((skel, len(var_values)), ([], []))
            rows[0].append([plan.rank, layer_of(w.param)] + var_values)
            rows[1].append(holes)
    # only the order among writes to one param matters: a stable sort by param makes it canonical
    ordered = {r: sorted(ws, key=lambda w: w.param) for r, ws in ordered.items()}
    groups: list[Group] = []
    for (skel, _), (var_rows, hole_rows) in sorted(by_skeleton.items(), key=lambda kv: repr(kv[0])):
        _make_groups(skel, np.asarray(var_rows, dtype=np.int64),
                     np.asarray(hole_rows, dtype=np.int64).reshape(len(hole_rows), -1), groups)
    return PlanBody(
        ranks=tuple(sorted(p.rank for p in plans)),
        sources=SourceTable.from_metas(sources),
        params=dict(sorted(params.items())),
        rank_params={p.rank: tuple(sorted(m.name for m in p.params)) for p in plans},
        groups=groups,
        ordered=ordered,
        fallbacks={p.rank: list(p.fallbacks) for p in plans if p.fallbacks},
        not_needed={p.rank: tuple(p.not_needed) for p in plans},
    )


def _write_sort_key(w: ir.Write):
    # free writes never share a destination box (identical boxes overlap and go to `ordered`): this key is total
    return (w.param, w.dst.offset, w.dst.sizes, w.dst.strides)


def instantiate(body: PlanBody, rank: int, check=None) -> ir.RankPlan:
    """The rank's plan: templated writes in canonical order, then its ordered (overlapping) writes.
    `check(group, holes)` is called per group before its writes are built (planfile's vectorised bounds check)."""
    if rank not in body.rank_params:
        raise KeyError(rank)
    writes: list[ir.Write] = []
    for g in body.groups:
        if check is not None:
            check(g, g.holes(rank))
        writes.extend(g.writes(rank))
    writes.sort(key=_write_sort_key)
    writes.extend(body.ordered.get(rank, ()))
    return ir.RankPlan(rank=rank, params=tuple(body.params[n] for n in body.rank_params[rank]),
                       writes=tuple(writes), fallbacks=tuple(body.fallbacks.get(rank, ())),
                       not_needed=tuple(body.not_needed.get(rank, ())))


def canonical(plan: ir.RankPlan) -> ir.RankPlan:
    """What instantiate() returns for a directly recorded plan: the reference for equality tests."""
    writes = [w for w in plan.writes if w.dst.numel > 0]
    overlapping = _overlapping_params(writes)
    free = sorted(set(w for w in writes if w.param not in overlapping), key=_write_sort_key)
    kept = sorted((w for w in writes if w.param in overlapping), key=lambda w: w.param)
    return ir.RankPlan(rank=plan.rank, params=tuple(sorted(plan.params, key=lambda p: p.name)),
                       writes=tuple(free + kept), fallbacks=tuple(plan.fallbacks), not_needed=tuple(plan.not_needed))


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


def extend_layers(body: PlanBody, full_layers: dict[int, list[int]], drop: set[int],
                  sources: Sequence[ir.TensorMeta]) -> PlanBody:
    """`full_layers[rep]`: every layer of rep's class (rep included); layers in `drop` were sampled only to check
    invariance. Rebuilds each group's index over all layers; the result equals compiling every layer directly."""
    groups: list[Group] = []
    for g in body.groups:
        rows = []
        for t in iter_trie(g.index):
            layer = t[1]
            if layer in drop:
                continue
            for new in full_layers.get(layer, [layer]):
                rows.append((t[0], new) + t[2:])
        if rows:
            groups.append(Group(g.skeleton, g.coeffs, build_trie(sorted(rows)), g.num_vars))
    params: dict[str, ir.TensorMeta] = {}
    rank_params: dict[int, tuple[str, ...]] = {}
    for rank, names in body.rank_params.items():
        out = set()
        for n in names:
            layer = layer_of(n)
            if layer in drop:
                continue
            for new in full_layers.get(layer, [layer]) if layer >= 0 else [layer]:
                renamed = n.replace(f"layers.{layer}.", f"layers.{new}.", 1) if layer >= 0 else n
                meta = body.params[n]
                params[renamed] = ir.TensorMeta(renamed, meta.shape, meta.dtype)
                out.add(renamed)
        rank_params[rank] = tuple(sorted(out))
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
    return PlanBody(ranks=body.ranks, sources=SourceTable.from_metas(sources),
                    params=dict(sorted(params.items())), rank_params=rank_params, groups=groups, ordered=ordered,
                    fallbacks=body.fallbacks, not_needed={})
