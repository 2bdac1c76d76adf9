"""Instantiating one rank of a plan file as columns (plan/columns.py), every bounds check vectorised.

Pure-view templates (`param[box] <- source[box]`: all but a handful of a plan's writes) go from their hole rows
straight to columns: only the holes that vary per write are computed per row (param and source name integers, the
two offsets); a template's box geometry (sizes, strides) rarely varies, so it is kept once per distinct geometry (a
class) and checked there; the columns keep the class tables (per-write size and stride matrices are gathered only
when asked). Templates of a few writes on the rank (qwen3-next: 111 of its 133 hold one) are computed together, one
numpy pass per hole layout, not per template. Param names are formatted once per distinct param, checkpoint tensors
are found by id (`TableSourceIds`) without formatting their names. The box rules of docs/plan-format.md are checked
on the columns; computed and ordered writes (rare) are built as `ir.Write` objects and checked one by one
(file/bounds.py: check_bounds), as before. The result equals tests/reference.py's `instantiate` write for write
(tests/unit/test_columns.py).
"""

from __future__ import annotations

import numpy as np

from shardplan.plan import ir
from shardplan.plan.body import PlanBody
from shardplan.plan.columns import WriteColumns, table_ids
from shardplan.plan.file.bounds import bad_geometry, check_bounds, check_extents
from shardplan.plan.file.errors import PlanBoundsError, advice
from shardplan.plan.rowkeys import Columns, distinct_rows, expand_trie, stable_argsort
from shardplan.plan.template import pure_view_form, trie_child, unflatten_write

_ROWS = ("param", "dst_offset", "src", "src_offset")  # per-write columns; geometry is per class


def rank_columns(body: PlanBody, rank: int, path: str) -> WriteColumns:
    """Rank `rank`'s writes (canonical order: free writes sorted, then ordered ones), bounds-checked."""
    names = body.rank_params[rank]
    param_index = {n: i for i, n in enumerate(names)}
    param_numels = np.asarray([body.meta(rank, n).numel for n in names] + [0], dtype=np.int64)
    ids = table_ids(body.sources)
    name_cache = _name_cache(body)
    blocks: list[dict] = []
    generic: list[ir.Write] = []
    small: dict[tuple, list] = {}  # hole layout -> [(form, coeffs, tail, position of its first write)]
    position = 0  # of a template's first write among the free writes, in template order (the stable sort's ties)
    for g in body.groups:
        child = trie_child(g.index, rank)
        if child is None:
            continue
        tail = expand_trie(child if child != () else None, g.num_vars - 1)
        if not len(tail):
            continue
        form = pure_view_form(g.skeleton)
        if form is None:
            var_rows = np.concatenate([np.full((len(tail), 1), rank, dtype=np.int64), tail], axis=1)
            holes = g.coeffs[:, :1].T + var_rows @ g.coeffs[:, 1:].T
            writes = [unflatten_write(g.skeleton, row) for row in holes.tolist()]
            generic += writes
            blocks.append(_object_block(names, writes, ids))
            blocks[-1]["position"] = position
        elif len(tail) <= _SMALL:
            small.setdefault((form[1], form[2], form[4], form[5], g.coeffs.shape), []).append(
                (form, g.coeffs, tail, position)
            )
        else:
            blocks.append(_pure_block(form, g.coeffs, rank, tail, param_index, ids, path, name_cache))
            blocks[-1]["position"] = position
        position += len(tail)
    blocks += [_small_block(items, rank, param_index, ids, path, name_cache) for items in small.values()]
    for block in blocks:
        if block["objects"] is None:
            for side in ("dst", "src"):
                _check_boxes(block, side, names, param_numels, ids, rank, path)
    ordered = list(body.ordered.get(rank, ()))
    generic += ordered
    # object writes first: one may name a param this rank does not declare, which the ordering below cannot index
    if generic:
        check_bounds(ir.RankPlan(rank, tuple(body.meta(rank, n) for n in names), tuple(generic)), body.sources, path)
    num_free = sum(len(b["param"]) for b in blocks)
    parts = blocks + ([_object_block(names, ordered, ids)] if ordered else [])
    rows, tables = _concat(parts)
    # the free writes' positions in template order, where small templates were batched out of it
    positions = (
        np.concatenate(
            [
                b["position"]
                if isinstance(b["position"], np.ndarray)
                else np.arange(b["position"], b["position"] + len(b["param"]))
                for b in blocks
            ]
        )
        if small
        else None
    )
    order = canonical_order(rows, tables["dst"], names, num_free, positions)
    if ordered:
        order = np.concatenate([order, np.arange(num_free, len(rows["param"]), dtype=np.int64)])
    cols = {k: v[order] for k, v in rows.items()}
    objects = (
        _computed_objects(blocks, order, ordered, num_free) if any(b["objects"] for b in blocks) or ordered else {}
    )
    computed = {i: w for i, w in objects.items() if not ir.is_pure_view(w)}
    return WriteColumns(
        names,
        cols["param"],
        cols["dst_offset"],
        None,
        None,
        None,
        cols["src"],
        cols["src_offset"],
        None,
        None,
        None,
        computed=computed,
        sources=ids,
        classes={"dst": cols["dst_class"], "src": cols["src_class"]},
        tables=tables,
    )


def _name_cache(body: PlanBody) -> dict:
    """(name template, integers) -> name, kept on the body: a process that instantiates several ranks formats the
    same param names."""
    cache = getattr(body, "_shardplan_names", None)
    if cache is None:
        cache = body._shardplan_names = {}
    return cache


def _pure_block(
    form, coeffs: np.ndarray, rank: int, tail: np.ndarray, param_index: dict, ids, path: str, names: dict
) -> dict:
    ptext, kp, nd, stext, ks, ns = form
    d1 = kp + 1 + 2 * nd
    s0 = d1 + ks
    n = len(tail)
    base = (coeffs[:, 0] + rank * coeffs[:, 1]).tolist()  # hole = base + var @ tail row (rank: the first var)
    var = coeffs[:, 2:]
    tail_t = np.ascontiguousarray(tail.T)
    scratch = np.empty(n, dtype=np.int64)

    def holes(lo: int, hi: int) -> Columns:
        """Holes lo..hi-1 over the writes, one 1-D pass per nonzero coefficient (plan/rowkeys.py: why not a matmul)."""
        out = []
        for h in range(lo, hi):
            terms = np.flatnonzero(var[h]).tolist()
            if len(terms) == 1 and var[h, terms[0]] == 1:  # hole = base + a variable (an expert, a layer)
                out.append(tail_t[terms[0]] + base[h])
                continue
            col = np.full(n, base[h], dtype=np.int64)
            for j in terms:  # in place, one scratch column: fresh temporaries cost page faults
                np.multiply(tail_t[j], var[h, j], out=scratch)
                col += scratch
            out.append(col)
        return Columns(out, n)

    param = _param_ids(ptext, holes(0, kp), param_index, rank, path, names)
    src_holes = holes(d1, s0)
    src, src_numel = ids.ids_numels(stext, src_holes)
    if (src < 0).any():
        bad = int(np.nonzero(src < 0)[0][0])
        name = stext.format(*[int(c[bad]) for c in src_holes.arrays])
        raise PlanBoundsError(f"{path}: rank {rank}: source {name} is not declared for this rank. " + advice(path))
    block = {
        "param": param,
        "dst_offset": holes(kp, kp + 1).arrays[0],
        "src": src,
        "src_offset": holes(s0, s0 + 1).arrays[0],
        "objects": None,
        "src_numel": src_numel,
    }
    for side, lo, ndim in (("dst", kp + 1, nd), ("src", s0 + 1, ns)):
        if not var[lo : lo + 2 * ndim].any():  # one geometry for every write of the template
            table = np.asarray(base[lo : lo + 2 * ndim], dtype=np.int64).reshape(1, 2 * ndim)
            klass = np.zeros(n, dtype=np.int64)
        else:
            geometry = holes(lo, lo + 2 * ndim)
            first, klass = distinct_rows(geometry)
            table = np.stack([c[first] for c in geometry.arrays], axis=1)
        block[f"{side}_class"] = klass
        block[f"{side}_table"] = (np.full(len(table), ndim, dtype=np.int64), table[:, :ndim], table[:, ndim:])
    return block


_SMALL = 64  # templates of at most this many writes on this rank are instantiated together (_small_block)


def _small_block(items: list, rank: int, param_index: dict, ids, path: str, names: dict) -> dict:
    """`_pure_block` for several small templates of one hole layout at once: a template's fixed numpy costs would
    otherwise be paid per write where fitting left one template per write (qwen3-next's conv1d boxes: 108 of them).
    Rows are in `items` order; "position" says where each sits among the free writes in template order."""
    ptext, kp, nd, stext, ks, ns = items[0][0]
    d1 = kp + 1 + 2 * nd
    s0 = d1 + ks
    counts = [len(tail) for _, _, tail, _ in items]
    tid = np.repeat(np.arange(len(items)), counts)
    coeffs = np.stack([c for _, c, _, _ in items])  # [templates, holes, 2 + tail vars]
    tail = np.concatenate([t for _, _, t, _ in items])
    holes = (coeffs[:, :, 0] + rank * coeffs[:, :, 1])[tid]
    for j in range(tail.shape[1]):
        holes += coeffs[:, :, 2 + j][tid] * tail[:, j : j + 1]
    n = len(holes)
    first, inverse = distinct_rows(Columns([tid] + [holes[:, h] for h in range(kp)], n))
    param = np.empty(len(first), dtype=np.int64)
    for k, (t, row) in enumerate(zip(tid[first].tolist(), holes[first, :kp].tolist())):
        text = items[t][0][0]
        name = names.get((text, tuple(row)))
        if name is None:
            name = names[(text, tuple(row))] = text.format(*row)
        i = param_index.get(name)
        if i is None:
            raise PlanBoundsError(
                f"{path}: rank {rank}: destination {name} is not declared for this rank. " + advice(path)
            )
        param[k] = i
    src = np.empty(n, dtype=np.int64)
    src_numel = np.empty(n, dtype=np.int64)
    texts = [form[3] for form, _, _, _ in items]
    for text in sorted(set(texts)):
        rows = np.flatnonzero(np.asarray([t == text for t in texts])[tid])
        src[rows], src_numel[rows] = ids.ids_numels(text, Columns([holes[rows, h] for h in range(d1, s0)], len(rows)))
    if (src < 0).any():
        bad = int(np.nonzero(src < 0)[0][0])
        name = texts[tid[bad]].format(*holes[bad, d1:s0].tolist())
        raise PlanBoundsError(f"{path}: rank {rank}: source {name} is not declared for this rank. " + advice(path))
    block = {
        "param": param[inverse],
        "dst_offset": holes[:, kp].copy(),
        "src": src,
        "src_offset": holes[:, s0].copy(),
        "objects": None,
        "src_numel": src_numel,
        "position": np.concatenate([np.arange(p, p + c) for (_, _, _, p), c in zip(items, counts)]),
    }
    for side, lo, ndim in (("dst", kp + 1, nd), ("src", s0 + 1, ns)):
        first, block[f"{side}_class"] = distinct_rows(Columns([holes[:, h] for h in range(lo, lo + 2 * ndim)], n))
        table = holes[first, lo : lo + 2 * ndim]
        block[f"{side}_table"] = (np.full(len(table), ndim, dtype=np.int64), table[:, :ndim], table[:, ndim:])
    return block


def _param_ids(ptext: str, holes: Columns, param_index: dict, rank: int, path: str, names: dict) -> np.ndarray:
    first, inverse = distinct_rows(holes)
    out = []
    for row in np.stack([c[first] for c in holes.arrays], axis=1).tolist() if holes.arrays else [[]] * len(first):
        key = (ptext, tuple(row))
        name = names.get(key)
        if name is None:  # file/checks.py admits only `{}` holes as braces: format is Filler.name
            name = names[key] = ptext.format(*row)
        i = param_index.get(name)
        if i is None:
            raise PlanBoundsError(
                f"{path}: rank {rank}: destination {name} is not declared for this rank. " + advice(path)
            )
        out.append(i)
    return np.asarray(out, dtype=np.int64)[inverse]


def _object_block(names, writes, ids) -> dict:
    cols = WriteColumns.from_writes(names, writes, ids)
    out = {k: getattr(cols, k) for k in _ROWS}
    out["objects"] = list(writes)
    for side in ("dst", "src"):
        ndim, sizes, strides = (getattr(cols, f"{side}_{k}") for k in ("ndim", "sizes", "strides"))
        first, out[f"{side}_class"] = distinct_rows(np.concatenate([ndim[:, None], sizes, strides], axis=1))
        out[f"{side}_table"] = (ndim[first], sizes[first], strides[first])
    return out


def _concat(blocks: list[dict]) -> tuple[dict, dict]:
    """(per-write columns of all blocks, {side: (ndim, sizes, strides) per class}); class ids numbered across blocks,
    tables padded to the widest box with size 1 / stride 0."""
    width = max([b[f"{side}_table"][1].shape[1] for b in blocks for side in ("dst", "src")] + [1])
    rows = {k: np.concatenate([b[k] for b in blocks]) if blocks else np.zeros(0, dtype=np.int64) for k in _ROWS}
    tables = {}
    for side in ("dst", "src"):
        num_classes = [len(b[f"{side}_table"][0]) for b in blocks]
        bases = np.cumsum([0] + num_classes)
        rows[f"{side}_class"] = (
            np.concatenate([b[f"{side}_class"] + base for b, base in zip(blocks, bases.tolist())])
            if blocks
            else np.zeros(0, dtype=np.int64)
        )
        ndim = np.zeros(int(bases[-1]), dtype=np.int64)
        sizes = np.ones((int(bases[-1]), width), dtype=np.int64)
        strides = np.zeros((int(bases[-1]), width), dtype=np.int64)
        for b, a, z in zip(blocks, bases[:-1].tolist(), bases[1:].tolist()):
            t_ndim, t_sizes, t_strides = b[f"{side}_table"]
            ndim[a:z] = t_ndim
            sizes[a:z, : t_sizes.shape[1]] = t_sizes
            strides[a:z, : t_strides.shape[1]] = t_strides
        tables[side] = (ndim, sizes, strides)
    return rows, tables


def _computed_objects(blocks, order, ordered, num_free) -> dict[int, ir.Write]:
    flat: list = []
    for b in blocks:
        flat += b["objects"] if b["objects"] is not None else [None] * len(b["param"])
    out = {}
    for new, old in enumerate(order[:num_free].tolist()):
        if flat[old] is not None:
            out[new] = flat[old]
    for j, w in enumerate(ordered):
        out[num_free + j] = w
    return out


def canonical_order(rows: dict, dst_table, names, num_free: int, positions: np.ndarray | None = None) -> np.ndarray:
    """The canonical order of a rank's free writes, once (tests/reference.py's write_sort_key restates it for
    objects), here on columns (the first `num_free` rows): (param name, dst offset, dst
    sizes, dst strides), stable: ties keep template order (`positions`: each row's place in it, where the rows are
    not in that order). Regions compare as tuples: a shorter tuple first on a tie, which -1 padding reproduces
    (sizes >= 1 and strides >= 0 are checked)."""
    if num_free == 0:
        return np.zeros(0, dtype=np.int64)
    param, offset = rows["param"][:num_free], rows["dst_offset"][:num_free]
    name_rank = np.empty(len(names), dtype=np.int64)
    name_rank[np.argsort(np.asarray(names, dtype=object), kind="stable")] = np.arange(len(names))
    param_rank = name_rank[param]
    span = int(offset.max()) - int(offset.min()) + 1
    if int(offset.min()) >= 0 and span * len(names) < 1 << 62:  # one packed key: one stable sort, not two
        order = stable_argsort(param_rank * span + (offset - int(offset.min())))
    else:
        order = np.lexsort((offset, param_rank))
    tied = (np.diff(param_rank[order]) == 0) & (np.diff(offset[order]) == 0)
    if not tied.any():  # (param, offset) decides: the usual case, free writes rarely share an offset
        return order
    # ties (few): rank each geometry class among the distinct (sizes, strides) tuples (a small table) and sort each
    # tied run by it, stably
    t_ndim, t_sizes, t_strides = dst_table
    real = np.arange(t_sizes.shape[1])[None, :] < t_ndim[:, None]
    table = np.concatenate([np.where(real, t_sizes, -1), np.where(real, t_strides, -1)], axis=1)
    by_tuple = np.lexsort(table.T[::-1])
    ranked = table[by_tuple]
    geo_rank = np.empty(len(table), dtype=np.int64)
    geo_rank[by_tuple] = np.cumsum(np.concatenate([[True], (ranked[1:] != ranked[:-1]).any(axis=1)])) - 1
    in_run = np.concatenate([tied, [False]]) | np.concatenate([[False], tied])
    run_id = np.cumsum(np.concatenate([[True], ~tied]))  # equal along a run of ties
    where = np.flatnonzero(in_run)
    sub = order[where]
    order = order.copy()
    keys = (geo_rank[rows["dst_class"][sub]], run_id[where])
    order[where] = sub[np.lexsort(keys if positions is None else (positions[sub],) + keys)]
    return order


def _check_boxes(block: dict, side: str, names, param_numels, ids, rank: int, path: str) -> None:
    """The box rules of file/bounds.py on one pure-view template's writes: the geometry once per class (distinct
    sizes, strides), offsets and extents per write (`check_extents`)."""
    _, t_sizes, t_strides = block[f"{side}_table"]
    klass = block[f"{side}_class"]
    numel = param_numels[block["param"]] if side == "dst" else block["src_numel"]
    offset = block[f"{side}_offset"]

    def refuse(j: int) -> str:
        what = "destination" if side == "dst" else "source"
        name = names[block["param"][j]] if side == "dst" else ids.name(int(block["src"][j]))
        sizes, strides = t_sizes[klass[j]], t_strides[klass[j]]
        return (
            f"{path}: rank {rank}: box (offset {int(offset[j])}, sizes {sizes.tolist()}, strides "
            f"{strides.tolist()}) is negative, {'empty, self-overlapping, ' if side == 'dst' else ''}"
            f"or lies outside {what} {name} ({int(numel[j])} elements). " + advice(path)
        )

    bad = bad_geometry(t_sizes, t_strides, destination=side == "dst")
    if bad.any():
        raise PlanBoundsError(refuse(int(np.nonzero(bad[klass])[0][0])))
    empty = (t_sizes == 0).any(axis=1)
    if empty.any():  # an empty source box reaches nothing, but its offset is a region's: non-negative
        negative = empty[klass] & (offset < 0)
        if negative.any():
            raise PlanBoundsError(refuse(int(np.nonzero(negative)[0][0])))
    check_extents(offset, klass, t_sizes, t_strides, numel, refuse)
