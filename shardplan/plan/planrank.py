"""Instantiating one rank of a plan file as columns (plan/columns.py), every bounds check vectorised.

Pure-view templates (`param[box] <- source[box]`: all but a handful of a plan's writes) go from their hole rows
straight to columns: param names are formatted once per distinct param, checkpoint tensors are found by id
(`TableSourceIds`) without formatting their names. The box rules of docs/plan-format.md are checked on the columns,
all writes at once; computed and ordered writes (rare) are built as `ir.Write` objects and checked one by one
(planbounds.check_bounds), as before. The result equals `compile.instantiate` write for write (tests/unit/test_columns.py).
"""
from __future__ import annotations

import numpy as np

from shardplan.plan import ir
from shardplan.plan.columns import WriteColumns, distinct_rows, expand_trie, row_keys, table_ids
from shardplan.plan.compile import PlanBody
from shardplan.plan.planbounds import _overlapping, check_bounds
from shardplan.plan.planerrors import PlanBoundsError, advice
from shardplan.plan.template import Filler, pure_view_form, trie_child, unflatten_write

_FIELDS = ("param", "dst_offset", "dst_ndim", "dst_sizes", "dst_strides", "src", "src_offset", "src_ndim",
           "src_sizes", "src_strides")
_CLASSES = ("dst_class", "src_class")


def rank_columns(body: PlanBody, rank: int, path: str) -> WriteColumns:
    """Rank `rank`'s writes (canonical order: free writes sorted, then ordered ones), bounds-checked."""
    names = body.rank_params[rank]
    param_index = {n: i for i, n in enumerate(names)}
    param_numels = np.asarray([body.params[n].numel for n in names] + [0], dtype=np.int64)
    ids = table_ids(body.sources)
    blocks: list[dict] = []
    generic: list[ir.Write] = []
    for g in body.groups:
        child = trie_child(g.index, rank)
        if child is None:
            continue
        tail = expand_trie(child if child != () else None, g.num_vars - 1)
        var_rows = np.concatenate([np.full((len(tail), 1), rank, dtype=np.int64), tail], axis=1)
        holes = g.coeffs[:, :1].T + var_rows @ g.coeffs[:, 1:].T
        form = pure_view_form(g.skeleton)
        if form is None:
            writes = [unflatten_write(g.skeleton, row) for row in holes.tolist()]
            generic += writes
            blocks.append(_object_block(names, writes, ids))
        else:
            block = _pure_block(form, g.coeffs, holes, param_index, ids, rank, path, _name_cache(body))
            for side in ("dst", "src"):
                _check_boxes(block, side, names, param_numels, ids, rank, path)
                block[f"{side}_class"] = (np.zeros(len(holes), dtype=np.int64) if block["constant"][side]
                                          else _classes(block, side))
            blocks.append(block)
    ordered = list(body.ordered.get(rank, ()))
    generic += ordered
    # object writes first: one may name a param this rank does not declare, which the ordering below cannot index
    if generic:
        check_bounds(ir.RankPlan(rank, tuple(body.params[n] for n in names), tuple(generic)), body.sources, path)
    num_free = sum(len(b["param"]) for b in blocks)
    free = _concat(blocks)
    order = _canonical_order(free, names)
    free = {k: v[order] for k, v in free.items() if k in _FIELDS + _CLASSES}
    cols = _concat([free, _object_block(names, ordered, ids)]) if ordered else free
    objects = _computed_objects(blocks, order, ordered, num_free) if any(
        b["objects"] for b in blocks) or ordered else {}
    computed = {i: w for i, w in objects.items() if not ir.is_pure_view(w)}
    return WriteColumns(names, *(cols[k] for k in _FIELDS), computed=computed, sources=ids,
                        classes={"dst": cols["dst_class"], "src": cols["src_class"]})


def _name_cache(body: PlanBody) -> dict:
    """(name template, integers) -> name, kept on the body: every rank formats the same param names."""
    cache = getattr(body, "_shardplan_names", None)
    if cache is None:
        cache = body._shardplan_names = {}
    return cache


def _pure_block(form, coeffs: np.ndarray, holes: np.ndarray, param_index: dict, ids, rank: int, path: str,
                names: dict) -> dict:
    ptext, kp, nd, stext, ks, ns = form
    d1 = kp + 1 + 2 * nd
    s0 = d1 + ks
    param = _param_ids(ptext, holes[:, :kp], param_index, rank, path, names)
    src, src_numel = ids.ids_numels(stext, holes[:, d1:s0])
    if (src < 0).any():
        bad = int(np.nonzero(src < 0)[0][0])
        name = Filler(holes[bad, d1:s0].tolist()).name(stext)
        raise PlanBoundsError(f"{path}: rank {rank}: source {name} is not declared for this rank. " + advice(path))
    n = len(holes)
    return {"param": param, "dst_offset": holes[:, kp], "dst_ndim": np.full(n, nd, dtype=np.int64),
            "dst_sizes": holes[:, kp + 1:kp + 1 + nd], "dst_strides": holes[:, kp + 1 + nd:d1],
            "src": src, "src_offset": holes[:, s0], "src_ndim": np.full(n, ns, dtype=np.int64),
            "src_sizes": holes[:, s0 + 1:s0 + 1 + ns], "src_strides": holes[:, s0 + 1 + ns:s0 + 1 + 2 * ns],
            "objects": None, "src_numel": src_numel,
            "constant": {side: not coeffs[cols, 1:].any() for side, cols in
                         (("dst", np.r_[kp + 1:d1]), ("src", np.r_[s0 + 1:s0 + 1 + 2 * ns]))}}


def _param_ids(ptext: str, holes: np.ndarray, param_index: dict, rank: int, path: str, names: dict) -> np.ndarray:
    keyed = row_keys(holes)
    if keyed is None:
        uniq, first, inverse = np.unique(holes, axis=0, return_index=True, return_inverse=True)
    else:
        uniq, first, inverse = np.unique(keyed[0], return_index=True, return_inverse=True)
    out = []
    for j in first.tolist():
        key = (ptext, tuple(holes[j].tolist()))
        name = names.get(key)
        if name is None:
            name = names[key] = Filler(key[1]).name(ptext)
        i = param_index.get(name)
        if i is None:
            raise PlanBoundsError(f"{path}: rank {rank}: destination {name} is not declared for this rank. "
                                  + advice(path))
        out.append(i)
    return np.asarray(out, dtype=np.int64)[inverse.reshape(-1)]


def _object_block(names, writes, ids) -> dict:
    cols = WriteColumns.from_writes(names, writes, ids)
    out = {k: getattr(cols, k) for k in _FIELDS}
    out["objects"] = list(writes)
    for side in ("dst", "src"):
        out[f"{side}_class"] = _classes(out, side)
    return out


def _classes(block: dict, side: str) -> np.ndarray:
    return distinct_rows(np.concatenate([block[f"{side}_ndim"][:, None], block[f"{side}_sizes"],
                                         block[f"{side}_strides"]], axis=1))[1]


def _concat(blocks: list[dict]) -> dict:
    width = max([b[k].shape[1] for b in blocks for k in ("dst_sizes", "src_sizes")] + [1])
    n = sum(len(b["param"]) for b in blocks)
    out = {}
    for k in _FIELDS:
        matrix = k.endswith("sizes") or k.endswith("strides")
        out[k] = (np.full((n, width), 1 if k.endswith("sizes") else 0, dtype=np.int64) if matrix
                  else np.empty(n, dtype=np.int64))
    for k in _CLASSES:
        out[k] = np.empty(n, dtype=np.int64)
    start, base = 0, {k: 0 for k in _CLASSES}
    for b in blocks:
        stop = start + len(b["param"])
        for k in _CLASSES:
            out[k][start:stop] = b[k] + base[k]
            base[k] += int(b[k].max(initial=-1)) + 1
        for k in _FIELDS:
            if b[k].ndim == 2:
                out[k][start:stop, :b[k].shape[1]] = b[k]
            else:
                out[k][start:stop] = b[k]
        start = stop
    return out


def _computed_objects(blocks, order, ordered, num_free) -> dict[int, ir.Write]:
    flat: list = []
    for b in blocks:
        flat += b["objects"] if b["objects"] is not None else [None] * len(b["param"])
    out = {}
    for new, old in enumerate(order.tolist()):
        if flat[old] is not None:
            out[new] = flat[old]
    for j, w in enumerate(ordered):
        out[num_free + j] = w
    return out


def _canonical_order(cols: dict, names) -> np.ndarray:
    """compile.instantiate's order: (param name, dst offset, dst sizes, dst strides), stable. Regions compare as
    tuples: a shorter tuple first on a tie, which -1 padding reproduces (sizes >= 1 and strides >= 0 are checked)."""
    n = len(cols["param"])
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    name_rank = np.empty(len(names), dtype=np.int64)
    name_rank[np.argsort(np.asarray(names, dtype=object), kind="stable")] = np.arange(len(names))
    param_rank = name_rank[cols["param"]]
    order = np.lexsort((cols["dst_offset"], param_rank))
    tied = (np.diff(param_rank[order]) == 0) & (np.diff(cols["dst_offset"][order]) == 0)
    if not tied.any():   # (param, offset) decides: the usual case, free writes rarely share an offset
        return order
    real = np.arange(cols["dst_sizes"].shape[1])[None, :] < cols["dst_ndim"][:, None]
    sizes = np.where(real, cols["dst_sizes"], -1)
    strides = np.where(real, cols["dst_strides"], -1)
    keys = [strides[:, j] for j in range(strides.shape[1] - 1, -1, -1)]
    keys += [sizes[:, j] for j in range(sizes.shape[1] - 1, -1, -1)]
    keys += [cols["dst_offset"], param_rank]
    return np.lexsort(keys)


def _check_boxes(block: dict, side: str, names, param_numels, ids, rank: int, path: str) -> None:
    """planbounds.check_group_bounds on one pure-view template's writes: the geometry (sizes, strides) is checked
    once per distinct geometry, offsets and extents per write."""
    sizes, strides = block[f"{side}_sizes"], block[f"{side}_strides"]
    geometry = np.concatenate([sizes, strides], axis=1)
    keyed = None if block["constant"][side] else row_keys(geometry)
    if block["constant"][side]:   # sizes and strides do not depend on the variables: one geometry
        uniq, first, inverse = None, np.zeros(1, dtype=np.int64), np.zeros(len(geometry), dtype=np.int64)
    elif keyed is None:
        uniq, first, inverse = np.unique(geometry, axis=0, return_index=True, return_inverse=True)
    else:
        uniq, first, inverse = np.unique(keyed[0], return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    # float64: exact for every in-bounds box (< 2^53), and overflow-free for hostile ones
    u_sizes, u_strides = sizes[first].astype(np.float64), strides[first].astype(np.float64)
    u_negative = (u_sizes < 0).any(axis=1) | (u_strides < 0).any(axis=1)
    u_empty = (u_sizes == 0).any(axis=1)
    u_reach = ((u_sizes - 1) * u_strides).sum(axis=1) + 1
    if side == "dst":
        u_bad = u_empty | _overlapping(u_sizes, u_strides)
        numel = param_numels[block["param"]].astype(np.float64)
    else:
        u_bad = np.zeros(len(first), dtype=bool)
        numel = block["src_numel"].astype(np.float64)
    offset = block[f"{side}_offset"].astype(np.float64)
    if len(first) == 1:
        bad = (offset < 0) | (offset + u_reach[0] > numel) & ~u_empty[0] | (u_negative[0] | u_bad[0])
    else:
        bad = (u_negative | u_bad)[inverse] | (offset < 0) | (~u_empty[inverse] & (offset + u_reach[inverse] > numel))
    if bad.any():
        j = int(np.nonzero(bad)[0][0])
        what = "destination" if side == "dst" else "source"
        name = names[block["param"][j]] if side == "dst" else ids.name(int(block["src"][j]))
        raise PlanBoundsError(f"{path}: rank {rank}: box (offset {int(offset[j])}, sizes {sizes[j].tolist()}, strides "
                              f"{strides[j].tolist()}) is negative, {'empty, self-overlapping, ' if side == 'dst' else ''}"
                              f"or lies outside {what} {name} ({int(numel[j])} elements). " + advice(path))
