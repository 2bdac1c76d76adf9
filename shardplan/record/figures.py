"""Per-rank figures of a recorded layout (checkpoint tensors read, fallbacks, bytes received), for every rank at once.

Counted from the templated body, one pass per template over all ranks (numpy), not one pass per rank: a body of 256
ranks costs about what a body of one costs. When the body is the cut model's (sampled layers), `multiplicity` says how
many layers of the whole model each recorded layer stands for (0 for a layer recorded only to check invariance), so
the figures are the whole model's without building its body twice.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import numpy as np

from shardplan.plan import ir
from shardplan.plan.compile import PlanBody
from shardplan.plan.rowkeys import distinct_rows, expand_trie
from shardplan.plan.inspect import _fill, _hole_layout
from shardplan.plan.names import layer_of


def rank_figures(body: PlanBody, multiplicity: Mapping[int, int] | None = None) -> dict[int, tuple[int, int, int]]:
    """rank -> (number of checkpoint tensors read, number of fallbacks, bytes received)."""
    mult = dict(multiplicity or {})

    def weight(layers: np.ndarray) -> np.ndarray:
        if not mult:
            return np.ones(len(layers), dtype=np.int64)
        keys = np.asarray(sorted(mult), dtype=np.int64)
        values = np.asarray([mult[k] for k in keys.tolist()], dtype=np.int64)
        at = np.minimum(np.searchsorted(keys, layers), len(keys) - 1)
        return np.where(keys[at] == layers, values[at], 1)

    nbytes: dict[int, int] = defaultdict(int)
    # the checkpoint tensors each rank reads, as rows (rank, the name's integers) per name template: one distinct-row
    # pass per template over all ranks (Python sets of per-rank tuples cost ~10 s for a 32-rank non-EP Kimi-K2)
    read: dict[str, list[np.ndarray]] = defaultdict(list)
    for g in body.groups:
        rows = expand_trie(g.index, g.num_vars)
        if not len(rows):
            continue
        holes = g.coeffs[:, :1].T + rows @ g.coeffs[:, 1:].T
        info = _hole_layout(g.skeleton)
        numel = np.prod(holes[:, info["sizes"]], axis=1) if info["sizes"] else np.ones(len(holes), dtype=np.int64)
        first_name = _fill(info["param_text"], holes[0, :info["num_name"]].tolist())
        size = ir.itemsize(body.params[first_name].dtype) if first_name in body.params else 2
        ranks, inverse = np.unique(rows[:, 0], return_inverse=True)
        sums = np.bincount(inverse.reshape(-1), weights=(numel * weight(rows[:, 1])).astype(np.float64))
        for rank, total in zip(ranks.tolist(), sums.tolist()):
            nbytes[rank] += int(total) * size
        for text, cols in _source_slots(g.skeleton):
            if "layers.{}." in text:
                cols = [1] + cols   # the source's layer index is fitted on the param layer (variable 1)
            read[text].append(rows[:, [0] + cols])
    for rank, writes in body.ordered.items():
        for w in writes:
            nbytes[rank] += w.dst.numel * ir.itemsize(body.params[w.param].dtype) * mult.get(layer_of(w.param), 1)
            for name in ir.sources(w.src.leaf):
                read[name].append(np.asarray([[rank]], dtype=np.int64))
    num_read: dict[int, int] = defaultdict(int)
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
    out = {}
    for rank in body.rank_params:
        fallbacks = body.fallbacks.get(rank, ())
        total = nbytes[rank]
        for f in fallbacks:
            meta = body.sources[f.source]
            total += meta.numel * ir.itemsize(meta.dtype)
        out[rank] = (num_read[rank], len(fallbacks), total)
    return out


def _layer_weight(key: tuple, mult: Mapping[int, int]) -> int:
    text, row = key
    if not mult:
        return 1
    if row:
        return mult.get(row[0], 1) if "layers.{}." in text else 1
    return mult.get(layer_of(text), 1)


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
