"""Per-rank figures of a recorded layout (checkpoint tensors read, fallbacks, bytes received), for every rank at once.

Counted from the templated body, one pass per template over a chunk of ranks (numpy), not one pass per rank: a body
of 256 ranks costs little more than a body of one, and the chunks (about CHUNK_ROWS rows expanded at once) keep the
memory flat in the number of ranks. When the body is the cut model's (sampled layers), `multiplicity` says how
many layers of the whole model each recorded layer stands for (0 for a layer recorded only to check invariance), so
the figures are the whole model's without building its body twice.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import numpy as np

from shardplan.plan import ir
from shardplan.plan.body import PlanBody
from shardplan.plan.inspect import _fill, _hole_layout
from shardplan.plan.names import layer_of
from shardplan.plan.rowkeys import distinct_rows, expand_trie
from shardplan.plan.template import trie_count

# rows expanded at once: the ranks are counted in chunks of about this many rows (at least one rank), so the memory
# does not grow with the number of ranks (a non-EP Kimi-K2 rank of the cut model has ~2k rows, x256 ranks)
CHUNK_ROWS = 1 << 16


def rank_figures(body: PlanBody, multiplicity: Mapping[int, int] | None = None) -> dict[int, tuple[int, int, int]]:
    """rank -> (number of checkpoint tensors read, number of fallbacks, bytes received)."""
    mult = dict(multiplicity or {})
    nbytes: dict[int, int] = defaultdict(int)
    num_read: dict[int, int] = defaultdict(int)
    for lo, hi in _rank_chunks(body):
        _count(body, lo, hi, mult, nbytes, num_read)
    out = {}
    for rank in body.rank_params:
        fallbacks = body.fallbacks.get(rank, ())
        total = nbytes[rank]
        for f in fallbacks:
            meta = body.sources[f.source]
            total += meta.numel * ir.itemsize(meta.dtype)
        out[rank] = (num_read[rank], len(fallbacks), total)
    return out


def _rank_chunks(body: PlanBody) -> list[tuple[int, int]]:
    """[lo, hi) rank ranges of about CHUNK_ROWS template rows each (ranks whose children are shared count once)."""
    rows: dict[int, int] = defaultdict(int)
    for g in body.groups:
        counted: dict[int, int] = {}
        for start, stop, step, child in g.index or ():
            num = counted.setdefault(id(child), trie_count(child))
            for rank in range(start, stop, step):
                rows[rank] += num
    chunks: list[tuple[int, int]] = []
    lo, total = None, 0
    for rank in sorted(set(rows) | set(body.rank_params) | set(body.ordered)):
        if lo is not None and total + rows[rank] > CHUNK_ROWS:
            chunks.append((lo, rank))
            lo, total = None, 0
        lo = rank if lo is None else lo
        total += rows[rank]
    if lo is not None:
        chunks.append((lo, max(rows.keys() | body.rank_params.keys() | body.ordered.keys()) + 1))
    return chunks


def _ranks_within(index, lo: int, hi: int):
    """The trie's runs of its first variable (the rank) cut to [lo, hi); None if none is left."""
    runs = []
    for start, stop, step, child in index or ():
        if start < lo:
            start += -(-(lo - start) // step) * step
        stop = min(stop, hi)
        if start < stop:
            runs.append((start, stop, step, child))
    return tuple(runs) or None


def _count(body: PlanBody, lo: int, hi: int, mult: dict, nbytes: dict, num_read: dict) -> None:
    """Adds the figures of ranks lo..hi-1 to `nbytes` and `num_read`."""

    def weight(layers: np.ndarray) -> np.ndarray:
        if not mult:
            return np.ones(len(layers), dtype=np.int64)
        keys = np.asarray(sorted(mult), dtype=np.int64)
        values = np.asarray([mult[k] for k in keys.tolist()], dtype=np.int64)
        at = np.minimum(np.searchsorted(keys, layers), len(keys) - 1)
        return np.where(keys[at] == layers, values[at], 1)

    # the checkpoint tensors each rank reads, as rows (rank, the name's integers) per name template: one distinct-row
    # pass per template over the chunk's ranks (Python sets of per-rank tuples are far slower on a large layout)
    read: dict[str, list[np.ndarray]] = defaultdict(list)
    for g in body.groups:
        index = _ranks_within(g.index, lo, hi)
        if index is None:
            continue
        rows = expand_trie(index, g.num_vars)
        if not len(rows):
            continue
        holes = g.coeffs[:, :1].T + rows @ g.coeffs[:, 1:].T
        info = _hole_layout(g.skeleton)
        numel = np.prod(holes[:, info["sizes"]], axis=1) if info["sizes"] else np.ones(len(holes), dtype=np.int64)
        first_name = _fill(info["param_text"], holes[0, : info["num_name"]].tolist())
        size = ir.itemsize(body.params[first_name].dtype) if first_name in body.params else 2
        ranks, inverse = np.unique(rows[:, 0], return_inverse=True)
        sums = np.bincount(inverse.reshape(-1), weights=(numel * weight(rows[:, 1])).astype(np.float64))
        for rank, total in zip(ranks.tolist(), sums.tolist()):
            nbytes[rank] += int(total) * size
        for text, cols in _source_slots(g.skeleton):
            if "layers.{}." in text:
                cols = [1] + cols  # the source's layer index is fitted on the param layer (variable 1)
            read[text].append(rows[:, [0] + cols])
    for rank, writes in body.ordered.items():
        if not lo <= rank < hi:
            continue
        for w in writes:
            nbytes[rank] += w.dst.numel * ir.itemsize(body.params[w.param].dtype) * mult.get(layer_of(w.param), 1)
            for name in ir.sources(w.src.leaf):
                read[name].append(np.asarray([[rank]], dtype=np.int64))
    for text, parts in read.items():
        for same in ([p for p in parts if p.shape[1] == w] for w in sorted({p.shape[1] for p in parts})):
            rows = np.concatenate(same)
            first, _ = distinct_rows(rows)
            rows = rows[first]
            if not mult:
                weights = np.ones(len(rows), dtype=np.int64)
            elif rows.shape[1] > 1:
                weights = weight(rows[:, 1]) if "layers.{}." in text else np.ones(len(rows), dtype=np.int64)
            else:
                weights = np.full(len(rows), mult.get(layer_of(text), 1), dtype=np.int64)
            ranks, inverse = np.unique(rows[:, 0], return_inverse=True)
            for rank, total in zip(ranks.tolist(), np.bincount(inverse.reshape(-1), weights=weights).tolist()):
                num_read[rank] += int(total)


def _source_slots(skeleton) -> list[tuple[str, list[int]]]:
    """(source name template, its variable columns) for each Source in a write skeleton."""
    out, pos = [], 2

    def walk(node):
        nonlocal pos
        if isinstance(node, tuple) and node:
            if node[0] == "S" and len(node) == 2 and isinstance(node[1], str):
                n = node[1].count("{}") - (1 if "layers.{}." in node[1] else 0)
                out.append((node[1], list(range(pos, pos + n))))
                pos += n
                return
            for child in node:
                walk(child)

    walk(skeleton[3])
    return out
