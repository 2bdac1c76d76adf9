"""Templating an extended layout without its N copies of rows: the groups `compile._make_groups` makes of every
rank's rows, made from the rank classes (plan/compile/extend.py's lines) instead.

A *block* is the rows of one template on a set of ranks: rank j's rows are `base + offsets[j] @ slopes`, row i of
every rank from row i of the base (a line's prediction moves every row of a template by the same per-axis slope); a
recorded rank is a block of one rank without axes. The templating needs three things of all rows, and none needs
them all:

* The exact affine fit of the holes on the variables (rank, layer, name ints). Each design row and each residual is
  linear in (1, rank, offsets): the rows of the ranks whose (1, rank, offsets) span the block's (at most 2 + number
  of axes) span every row of the block, so the fit on those ranks' rows is the fit on all of them, and it is exact on
  those iff it is exact on all (same columns kept, same coefficients, same first failing hole).
* A split by the value of a failing hole: a hole that does not move with the rank on any row of a block (slope 0)
  splits the block's rows and keeps its ranks; a block whose hole does move is expanded to one block per rank (a
  TP offset over DP replicas: a few rows per rank). Where the ranks are fewer than the hole's values, `_make_groups`
  splits by rank instead, and so does this (one block per rank).
* The index trie: its rank level is one child trie per rank; the ranks of a block whose variables do not move share
  one child, and variables that move by the same amount on every row (EP: expert indices) shift that child.

Rows sharing their variables within a rank (one source copied to several places, or two predicted rows that meet)
are what `_make_groups` splits first; a set of blocks holding some is handed to `_make_groups` as rows, so it splits
them exactly as compiling every rank does. Every path gives the groups `_make_groups` makes of the materialised rows,
in the same order (tests/unit/test_extend_ranks.py compares the bytes on synthetic layouts, bench/compile_bench.py on
real ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardplan.plan.body import Group
from shardplan.plan.compile.compiler import _fit, _make_groups, split_by_rank
from shardplan.plan.rowkeys import distinct_rows
from shardplan.plan.template import trie_from_rows, trie_node


@dataclass(frozen=True, eq=False)
class Block:
    """Rows of one template on `ranks`, without the rank column: [layer, name ints | holes]."""

    ranks: np.ndarray  # int64 [m]
    offsets: np.ndarray  # int64 [m, num_axes]: each rank's coordinate minus the line's base coordinate, per axis
    base: np.ndarray  # int64 [n, width]
    slopes: np.ndarray  # int64 [num_axes, n, width]
    distinct: bool  # the variables of each rank's rows are distinct (checked for every rank)
    spanning: np.ndarray  # indices of the fewest ranks whose (1, rank, offsets) span those of all the block's ranks

    def rows(self, j: int) -> np.ndarray:
        """Rank `self.ranks[j]`'s rows."""
        if not len(self.slopes):
            return self.base
        return self.base + np.tensordot(self.offsets[j], self.slopes, axes=1)

    def take(self, mask: np.ndarray) -> "Block":
        return Block(self.ranks, self.offsets, self.base[mask], self.slopes[:, mask], self.distinct, self.spanning)


def literal(rank: int, rows: np.ndarray, num_vars: int, distinct: bool | None = None) -> Block:
    """A recorded rank's rows (sorted, unique) as a block of one rank (`distinct`: known, else checked)."""
    rows = np.asarray(rows, dtype=np.int64)
    return Block(
        np.asarray([rank], dtype=np.int64),
        np.zeros((1, 0), dtype=np.int64),
        rows,
        np.zeros((0,) + rows.shape, dtype=np.int64),
        _distinct(rows[:, :num_vars]) if distinct is None else distinct,
        np.zeros(1, dtype=np.int64),
    )


def line_block(ranks, offsets, base: np.ndarray, slopes: np.ndarray, num_vars: int) -> list[Block]:
    """The ranks predicted on one line, as one block; or one block per rank (rows made unique, as compile dedupes)
    where a prediction repeats variables on some rank."""
    ranks = np.asarray(ranks, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64).reshape(len(ranks), -1)
    block = Block(ranks, offsets, base, slopes.reshape(-1, *base.shape), True, _spanning(ranks, offsets))
    if len(block.slopes) == 0 or not _uniform(block.slopes[:, :, :num_vars]):
        if all(_distinct(block.rows(j)[:, :num_vars]) for j in range(len(block.ranks))):
            return [block]
    elif _distinct(base[:, :num_vars]):  # variables translated alike on every row: distinct on one rank, on all
        return [block]
    return [literal(int(r), np.unique(block.rows(j), axis=0), num_vars) for j, r in enumerate(block.ranks.tolist())]


def groups_of_blocks(skeleton, blocks: list[Block], num_vars: int, out: list[Group]) -> None:
    """`_make_groups(skeleton, var rows, hole rows, out)` on the rows of `blocks` (rank first), every block's ranks
    its own. `num_vars` counts the variables without the rank."""
    if not all(b.distinct for b in blocks):
        var_rows, hole_rows = _materialise(blocks, num_vars)
        _make_groups(skeleton, var_rows, hole_rows, out)
        return
    num_holes = blocks[0].base.shape[1] - num_vars
    if num_holes == 0:
        out.append(Group(skeleton, np.zeros((0, num_vars + 2), dtype=np.int64), _trie(blocks, num_vars), num_vars + 1))
        return
    coeffs, bad = _fit(*_materialise(blocks, num_vars, spanning=True))
    if coeffs is not None:
        out.append(Group(skeleton, coeffs, _trie(blocks, num_vars), num_vars + 1))
        return
    column = num_vars + bad
    num_ranks = sum(len(b.ranks) for b in blocks)
    if split_by_rank(num_ranks, _num_values(blocks, column)):
        for rank, b, j in sorted(
            ((r, b, j) for b in blocks for j, r in enumerate(b.ranks.tolist())), key=lambda t: t[0]
        ):
            groups_of_blocks(skeleton, [literal(rank, b.rows(j), num_vars, b.distinct)], num_vars, out)
        return
    by_value: dict[int, list[Block]] = {}  # split by the hole's value, in block order within each part
    for b in blocks:
        if len(b.slopes) and b.slopes[:, :, column].any():  # the hole moves with the rank: one block per rank
            parts = [literal(int(r), b.rows(j), num_vars, b.distinct) for j, r in enumerate(b.ranks.tolist())]
        else:
            parts = [b]
        for part in parts:
            values, inverse = np.unique(part.base[:, column], return_inverse=True)
            if len(values) == 1:
                by_value.setdefault(int(values[0]), []).append(part)
                continue
            for i, value in enumerate(values.tolist()):
                by_value.setdefault(value, []).append(part.take(inverse.reshape(-1) == i))
    for value in sorted(by_value):
        groups_of_blocks(skeleton, by_value[value], num_vars, out)


def _num_values(blocks: list[Block], column: int) -> int:
    """How many values the column takes over every rank's rows (a moving column: one [ranks, rows] matrix of it)."""
    parts = []
    for b in blocks:
        if len(b.slopes) and b.slopes[:, :, column].any():
            parts.append((b.base[:, column][None, :] + b.offsets @ b.slopes[:, :, column]).reshape(-1))
        else:
            parts.append(b.base[:, column])
    return len(np.unique(np.concatenate(parts)))


def _distinct(var_rows: np.ndarray) -> bool:
    return len(distinct_rows(var_rows)[0]) == len(var_rows)


def _uniform(slopes: np.ndarray) -> bool:
    """Every row moves by the same amount (per axis)."""
    return bool((slopes == slopes[:, :1]).all())


def _spanning(ranks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Indices of the fewest ranks whose points (1, rank, offsets) span all the ranks' points (greedy, in order)."""
    points = np.concatenate([np.ones((len(ranks), 1)), ranks[:, None], offsets], axis=1).astype(np.float64)
    full = np.linalg.matrix_rank(points)
    keep: list[int] = []
    for j in range(len(ranks)):
        if np.linalg.matrix_rank(points[keep + [j]]) == len(keep) + 1:
            keep.append(j)
            if len(keep) == full:
                break
    return np.asarray(keep, dtype=np.int64)


def _materialise(blocks: list[Block], num_vars: int, spanning: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(var rows with the rank first, hole rows) of every rank of every block (of its spanning ranks only)."""
    parts = []
    for b in blocks:
        for j in b.spanning.tolist() if spanning else range(len(b.ranks)):
            rank, rows = int(b.ranks[j]), b.rows(j)
            parts.append(np.concatenate([np.full((len(rows), 1), rank, dtype=np.int64), rows], axis=1))
    rows = np.concatenate(parts)
    return rows[:, : num_vars + 1], rows[:, num_vars + 1 :]


def _trie(blocks: list[Block], num_vars: int):
    """`trie_from_rows` of the blocks' variable rows (rank first), one child trie per rank built once per block
    where the block's variables do not move with the rank, or move alike on every row."""
    pairs = []
    for b in blocks:
        var_slopes = b.slopes[:, :, :num_vars]
        if len(b.ranks) == 1 or not var_slopes.any():
            child = trie_from_rows(b.rows(0)[:, :num_vars])
            pairs.extend((rank, child) for rank in b.ranks.tolist())
        elif _uniform(var_slopes):
            first = trie_from_rows(b.rows(0)[:, :num_vars])
            moves = (b.offsets - b.offsets[:1]) @ var_slopes[:, 0, :]
            pairs.extend((rank, shift_trie(first, move)) for rank, move in zip(b.ranks.tolist(), moves.tolist()))
        else:
            pairs.extend((rank, trie_from_rows(b.rows(j)[:, :num_vars])) for j, rank in enumerate(b.ranks.tolist()))
    pairs.sort(key=lambda p: p[0])
    return trie_node(pairs)


def shift_trie(node, move: list[int]):
    """The trie of the same tuples with `move[d]` added to variable d: the same runs, moved (sorting and the equal
    children that runs merge do not change under a translation)."""
    if not any(move):
        return node
    done: dict[tuple[int, int], tuple] = {}

    def rec(node, depth: int):
        if node is None:
            return None
        got = done.get((id(node), depth))
        if got is None:
            d = move[depth]
            got = done[(id(node), depth)] = tuple(
                (start + d, stop + d, step, rec(child, depth + 1)) for start, stop, step, child in node
            )
        return got

    return rec(node, 0)
