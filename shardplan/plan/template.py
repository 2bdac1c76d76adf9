"""Write templates: an IR write flattened to (skeleton, integers) and back, and index sets as tries of ranges.

A skeleton is a write's structure with each integer replaced by a hole and each digit group of a dotted name replaced
by `{}`; it is hashable and msgpack-able, so writes of the same shape (one per layer, expert, rank) share it and
differ only in their integers. The compiler (`plan/compile/`) fits those integers as affine functions of the rank,
the layer and the name indices; the index sets of a template are compressed tries of ranges.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from typing import Iterable, Sequence

import numpy as np

from shardplan.plan import ir
from shardplan.plan.names import layer_hole

_DIGITS = re.compile(r"(?<=\.)\d+(?=\.|$)")

# ---- flatten / unflatten: IR <-> (skeleton, ints) ---------------------------------------------------------
# A skeleton is a nested tuple of tags, strings, floats, bools and HOLE markers; it is hashable and msgpack-able.
HOLE = "\x00#"


def split_name(name: str, ints: list[int]) -> str:
    def repl(m):
        ints.append(int(m.group(0)))
        return "{}"

    return _DIGITS.sub(repl, name.replace("{", "{{").replace("}", "}}"))


def flatten_write(w: ir.Write) -> tuple[tuple, list[int], list[int]]:
    """-> (skeleton, holes, vars). vars = the integers of the checkpoint names the write reads, in order."""
    holes: list[int] = []
    var_values: list[int] = []
    skel = ("W", _name(w.param, holes), _region(w.dst, holes), _view(w.src, holes, var_values))
    return skel, holes, var_values


def _name(name: str, holes: list[int]) -> tuple:
    return ("n", split_name(name, holes))


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
        text = split_name(leaf.name, holes)
        # the source's layer index is not a variable of its own: it is fitted on the param's layer (variable 1),
        # which keeps index tries from repeating one subtree per layer
        skip = layer_hole(text)
        var_values.extend(v for i, v in enumerate(holes[before:]) if i != skip)
        return ("S", text)
    if isinstance(leaf, ir.Full):
        value = leaf.value
        return ("F", ("f", float(value)) if isinstance(value, float) else value, _ints(leaf.sizes, holes), leaf.dtype)
    if isinstance(leaf, ir.Call):
        return (
            "C",
            leaf.op,
            tuple(_lit(a, holes) for a in leaf.args),
            tuple((k, _lit(v, holes)) for k, v in leaf.kwargs),
            tuple(_view(v, holes, var_values) for v in leaf.inputs),
            leaf.out,
        )
    if isinstance(leaf, ir.Update):
        return (
            "U",
            _leaf(leaf.base, holes, var_values),
            _region(leaf.region, holes),
            _view(leaf.value, holes, var_values),
        )
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


class Filler:
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
            return ir.Call(
                s[1],
                tuple(self.lit(a) for a in s[2]),
                tuple((k, self.lit(v)) for k, v in s[3]),
                tuple(self.view(v) for v in s[4]),
                s[5],
            )
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


def pure_view_form(skel: tuple):
    """For the common skeleton `param[box] <- source[box]`: (param text, #param holes, dst ndim, source text,
    #source holes, src ndim); None for any other skeleton."""
    try:
        tag, (n, ptext), (r1, off1, sizes1, strides1), (v, (s_tag, stext), (r2, off2, sizes2, strides2)) = skel
    except (TypeError, ValueError):
        return None
    if (tag, n, r1, v, s_tag, r2) != ("W", "n", "r", "v", "S", "r"):
        return None
    return ptext, ptext.count("{}"), len(sizes1), stext, stext.count("{}"), len(sizes2)


def unflatten_write(skel: tuple, holes: Sequence[int]) -> ir.Write:
    return Filler(holes).write(skel)


# ---- index sets: compressed tries of ranges ---------------------------------------------------------------
# A trie node is a tuple of (start, stop, step, child) runs; child is None at the last variable. Equal children of
# consecutive values merge into one arithmetic run, so product-like sets (all layers x these experts) stay tiny.


def build_trie(tuples: Sequence[tuple[int, ...]], depth: int = 0):
    if not tuples or len(tuples[0]) == depth:
        return None
    by_value: dict[int, list] = {}
    for t in tuples:
        by_value.setdefault(t[depth], []).append(t)
    return trie_node((value, build_trie(by_value[value], depth + 1)) for value in sorted(by_value))


def trie_from_rows(rows: np.ndarray):
    """`build_trie(sorted(map(tuple, rows.tolist())))` for distinct int64 rows, with numpy: one call per inner node
    instead of Python work per row (an extended 256-rank layout templates ~10^6 rows)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows) or rows.shape[1] == 0:
        return None
    return _trie_block(rows[np.lexsort(rows.T[::-1])], 0)


def _trie_block(rows: np.ndarray, depth: int):
    column = rows[:, depth]
    if depth == rows.shape[1] - 1:  # leaves (distinct): one arithmetic run is the usual case
        if len(column) == 1:
            return ((int(column[0]), int(column[0]) + 1, 1, None),)
        steps = np.diff(column)
        if (steps == steps[0]).all():
            return ((int(column[0]), int(column[-1] + steps[0]), int(steps[0]), None),)
        return trie_node((v, None) for v in column.tolist())
    bounds = np.flatnonzero(np.concatenate([[True], column[1:] != column[:-1]])).tolist() + [len(column)]
    return trie_node((int(column[a]), _trie_block(rows[a:b], depth + 1)) for a, b in zip(bounds[:-1], bounds[1:]))


def trie_node(pairs) -> tuple:
    """A trie node from (value, child) pairs sorted by value: equal children at a constant step merge into one run."""
    runs: list[list] = []  # [start, last, step (0: single value so far), child]
    for value, child in pairs:
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
    """The sub-trie under first variable == value (None if absent; () when value is the last variable).
    Runs are sorted by start and disjoint (the plan reader checks it): a binary search finds the only candidate."""
    if not node:
        return None
    i = bisect_right(node, value, key=_run_start) - 1
    if i < 0:
        return None
    start, stop, step, child = node[i]
    if value < stop and (value - start) % step == 0:
        return child if child is not None else ()
    return None


def _run_start(run) -> int:
    return run[0]


def trie_count(node) -> int:
    """Number of tuples in a trie, counted without expanding it (None, a leaf, holds one empty tuple)."""
    if node is None or node == ():
        return 1
    return sum((stop - start) // step * trie_count(child) for start, stop, step, child in node)
