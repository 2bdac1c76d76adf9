"""Integer rows as keys, with numpy: index tries expanded to rows, one mixed-radix int64 key per row, distinct rows
numbered (plan/columns.py, plan/file/rank.py and runtime/segments.py build on these).

Column by column where it matters: numpy's integer matmul and its reductions along a short last axis cost an order of
magnitude more than the equivalent 1-D passes over columns (`Columns` holds a matrix as its columns).
"""

from __future__ import annotations

import numpy as np


# ---- tries -> arrays --------------------------------------------------------------------------------------------
def expand_trie(node, width: int) -> np.ndarray:
    """Every tuple of an index trie (template.iter_trie order) as int64 rows [num_tuples, width], with numpy."""
    if node is None or node == ():
        return np.zeros((1, 0), dtype=np.int64)
    cache: dict[int, np.ndarray] = {}

    def rec(node) -> np.ndarray:
        got = cache.get(id(node))
        if got is not None:
            return got
        parts = []
        for start, stop, step, child in node:
            values = np.arange(start, stop, step, dtype=np.int64)
            if child is None:
                parts.append(values[:, None])
            else:
                sub = rec(child)
                parts.append(
                    np.concatenate([np.repeat(values, len(sub))[:, None], np.tile(sub, (len(values), 1))], axis=1)
                )
        out = np.concatenate(parts) if parts else np.zeros((0, width), dtype=np.int64)
        cache[id(node)] = out
        return out

    rows = rec(node)
    return rows.reshape(len(rows), width)


def row_keys(rows) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """One int64 key per row (mixed radix over each column's [min, max]); equal rows <-> equal keys. Returns
    (keys, lows, multipliers) or None when the radix product would not fit in 63 bits. `rows`: a [n, k] matrix or
    `Columns` (k arrays of n). Column by column, as the module says."""
    rows = rows if isinstance(rows, Columns) else Columns.of(rows)
    n, k = rows.n, len(rows.arrays)
    if k == 0:
        return np.zeros(n, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lows = np.asarray([int(c.min()) if n else 0 for c in rows.arrays], dtype=np.int64)
    spans = np.asarray(
        [int(c.max()) - int(lo) + 1 if n else 1 for c, lo in zip(rows.arrays, lows.tolist())], dtype=object
    )  # Python ints: a hostile span does not wrap
    mults = np.ones(k, dtype=np.int64)
    total = 1
    for j in range(k - 1, -1, -1):
        mults[j] = total
        total *= int(spans[j])
        if total >= 1 << 62:
            return None
    keys = np.zeros(n, dtype=np.int64)
    term = np.empty(n, dtype=np.int64)  # one scratch column, in place: fresh temporaries cost page faults
    for c, lo, m, span in zip(rows.arrays, lows.tolist(), mults.tolist(), spans.tolist()):
        if span > 1:  # a constant column adds nothing
            np.subtract(c, lo, out=term)
            if m != 1:
                term *= m
            keys += term
    return keys, lows, mults


class Columns:
    """A [n, k] integer matrix held as k 1-D arrays (n given: k may be 0)."""

    def __init__(self, arrays, n: int):
        self.arrays, self.n = list(arrays), n

    @classmethod
    def of(cls, matrix: np.ndarray) -> "Columns":
        matrix = np.asarray(matrix, dtype=np.int64)
        return cls([matrix[:, j] for j in range(matrix.shape[1])], len(matrix))

    def matrix(self) -> np.ndarray:
        return np.stack(self.arrays, axis=1) if self.arrays else np.zeros((self.n, 0), dtype=np.int64)


_HASH = np.random.default_rng(20261201).integers(1, 1 << 63, size=64, dtype=np.int64).astype(np.uint64) | 1


def distinct_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first row of each distinct row, distinct id per row). Rows become one int64 key each (mixed
    radix when it fits, else a multiplicative hash checked for collisions); keys of a small range are numbered
    without sorting."""
    n = matrix.n if isinstance(matrix, Columns) else len(matrix)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    keyed = row_keys(matrix)
    if keyed is None and isinstance(matrix, Columns):  # renumber the widest columns densely until the radix fits
        arrays = list(matrix.arrays)
        spans = [int(c.max()) - int(c.min()) + 1 for c in arrays]
        while keyed is None and max(spans) > n:
            j = spans.index(max(spans))
            arrays[j] = first_inverse(arrays[j])[1]  # equal values <-> equal ordinals: distinct rows unchanged
            spans[j] = int(arrays[j].max()) + 1
            keyed = row_keys(Columns(arrays, n))
    if keyed is not None:
        keys = keyed[0]
        top = int(keys.max()) + 1
        if top <= 4 * n + 4096:
            present = np.zeros(top, dtype=bool)
            present[keys] = True
            dense = np.cumsum(present) - 1
            inverse = dense[keys]
            first = np.full(int(dense[-1]) + 1, n, dtype=np.int64)
            np.minimum.at(first, inverse, np.arange(n, dtype=np.int64))
            return first, inverse
    if keyed is not None:  # exact keys
        return first_inverse(keys)
    if isinstance(matrix, Columns):  # only the exact keys above work on columns
        matrix = matrix.matrix()
    if matrix.shape[1] <= len(_HASH):
        with np.errstate(over="ignore"):
            keys = (matrix.astype(np.uint64) * _HASH[: matrix.shape[1]]).sum(axis=1, dtype=np.uint64).view(np.int64)
        first, inverse = first_inverse(keys)
        if (np.take(np.take(matrix, first, axis=0), inverse, axis=0) == matrix).all():
            return first, inverse
    _, first, inverse = np.unique(matrix, axis=0, return_index=True, return_inverse=True)  # a hash collision
    return first, inverse.reshape(-1)


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """np.argsort(keys, kind="stable"), faster: when (key range x n) fits in int64, the row index is packed under
    the key and the packed values are sorted (unique, so any sort is stable; numpy's int64 sort is much faster than its
    stable argsort)."""
    n = len(keys)
    if n < 2:
        return np.arange(n, dtype=np.int64)
    lo, hi = int(keys.min()), int(keys.max())
    if (hi - lo + 1) * n >= 1 << 62:
        return np.argsort(keys, kind="stable")
    packed = np.sort((keys - lo) * n + np.arange(n, dtype=np.int64))
    return packed % n


def first_inverse(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(keys, return_index=True, return_inverse=True)[1:], by one stable sort."""
    order = stable_argsort(keys)
    ranked = keys[order]
    new = np.empty(len(keys), dtype=bool)
    new[:1] = True
    np.not_equal(ranked[1:], ranked[:-1], out=new[1:])
    inverse = np.empty(len(keys), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return order[new], inverse
