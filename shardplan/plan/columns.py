"""Columnar rank plans: a rank's writes as numpy columns (one row per write) instead of one `ir.Write` per write.

A large rank has tens of thousands of writes (a non-EP Kimi-K2 TP32 rank: ~70k): as Python objects they cost more to
build and walk than the rest of loading a rank (docs/benchmarks.md, "Instantiating a plan").
`WriteColumns` holds, per write i: the param it writes (`param[i]`, an index into `param_names`), its destination
region (`dst_offset`, `dst_ndim`, `dst_sizes`, `dst_strides`), and for a pure view `param[box] <- source[box]` the
checkpoint tensor (`src[i]`, an id in `sources`, a `SourceIds`) and the source region (`src_*`). Region rows are
padded to the widest region of the rank with size 1 / stride 0 (neutral for numel and extent); `*_ndim` says how many
dims are real. Columns of a plan file's rank hold the region geometry per class instead (a template's writes share
one): the per-write matrices are gathered on first access, `geometry_rows` reads only the rows it is asked for.
Computed writes (Call/Full/Update leaves: rare) keep their `ir.Write` in `computed` and `src[i] == -1`.

`LazyWrites` is the `RankPlan.writes` of a columnar plan: a sequence that builds `ir.Write` objects only when asked
(printing, tests); `columns_of(plan)` gives the columns of any plan (built from objects when the plan has none).
Source ids come from a `SourceIds` table: `TableSourceIds` numbers the names of a plan file's templated source table
without materialising them (the id of `model.layers.{}.x` with holes [7] is found by a binary search over the
template's expanded index), `NameSourceIds` numbers explicit names (plans built from objects).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from shardplan.plan import ir
from shardplan.plan.rowkeys import Columns, distinct_rows, expand_trie, row_keys  # noqa: F401 (re-exported)
from shardplan.plan.template import Filler, split_name


# ---- source ids -----------------------------------------------------------------------------------------------
class SourceIds:
    """Numbers checkpoint tensor names: `ids(text, holes)` -> int64 ids (-1: not a name of this table)."""

    def ids(self, text: str, holes: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def name(self, i: int) -> str:
        raise NotImplementedError

    def meta(self, i: int) -> ir.TensorMeta:
        raise NotImplementedError

    def ids_of_names(self, names: Iterable[str]) -> np.ndarray:
        out = []
        for name in names:
            ints: list[int] = []
            text = split_name(name, ints)
            out.append(int(self.ids(text, np.asarray([ints], dtype=np.int64).reshape(1, len(ints)))[0]))
        return np.asarray(out, dtype=np.int64)

    def renamed(self, ids: np.ndarray, rename) -> np.ndarray:
        """The id of `rename(name)` for each id's name (-1 where it returns None or names no tensor of this table):
        a weight's scale tensor by its suffix, without spelling out names where the table is templated."""
        out = []
        for i in ids.tolist():
            other = rename(self.name(i))
            out.append(-1 if other is None else int(self.ids_of_names([other])[0]))
        return np.asarray(out, dtype=np.int64)

    def dtype_codes(self, ids: np.ndarray, table: Mapping[str, ir.TensorMeta]) -> tuple[np.ndarray, list[str]] | None:
        """(code per id, the dtype names the codes index) as `table` describes the tensors, where this id table can
        say so without names; else None."""
        return None

    def numels(self, ids: np.ndarray, table: Mapping[str, ir.TensorMeta] | None = None) -> np.ndarray:
        """Elements of each id's tensor as `table` (default: this id table's own) describes it; -1 where `table`
        does not hold the name."""
        uniq, inverse = np.unique(ids, return_inverse=True)
        out = np.empty(len(uniq), dtype=np.int64)
        for j, i in enumerate(uniq.tolist()):
            meta = self.meta(i) if table is None else table.get(self.name(i))
            out[j] = -1 if meta is None else meta.numel
        return out[inverse.reshape(-1)]


class NameSourceIds(SourceIds):
    """Ids of explicit names (the position in `names`), for plans built from `ir.Write` objects."""

    def __init__(self, names: Sequence[str], metas: Mapping[str, ir.TensorMeta] | None = None):
        self.names = tuple(names)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.metas = metas

    def ids(self, text: str, holes: np.ndarray) -> np.ndarray:
        return np.asarray([self._index.get(Filler(row).name(text), -1) for row in holes.tolist()], dtype=np.int64)

    def ids_of_names(self, names: Iterable[str]) -> np.ndarray:
        return np.asarray([self._index.get(n, -1) for n in names], dtype=np.int64)

    def name(self, i: int) -> str:
        return self.names[i]

    def meta(self, i: int) -> ir.TensorMeta | None:
        return None if self.metas is None else self.metas.get(self.names[i])


class TableSourceIds(SourceIds):
    """Ids of a templated source table's names (`compile.SourceTable`), without materialising the names: id =
    first id of the template row + position of the name's integers among the row's (sorted) index tuples."""

    def __init__(self, table):
        self.table = table
        self.texts, self.metas_by_row, bases, self._rows, self._keys = [], [], [], [], []
        self._by_text: dict[str, list[int]] = {}
        total = 0
        for r, (text, shape, dtype, index) in enumerate(table.templates):
            width = text.count("{}")
            rows = expand_trie(index, width) if index is not None else np.zeros((1, 0), dtype=np.int64)
            keyed = row_keys(rows)
            if keyed is None:  # a radix too wide for int64 keys: file/checks.py's hole limits make this unreachable
                keys, order = None, np.lexsort(rows.T[::-1]) if width else np.arange(len(rows))
            else:
                # an index trie expands in lexicographic order (its runs are sorted and disjoint): no sort then
                in_order = bool((keyed[0][1:] > keyed[0][:-1]).all())
                order = slice(None) if in_order else np.argsort(keyed[0], kind="stable")
                sorted_keys = keyed[0][order]
                highs = rows.max(axis=0) if len(rows) else keyed[1]
                # every key of the box [lows, highs] (an in-range query can be any of them, present or not)
                span = (
                    int(
                        np.prod(
                            [int(h) - int(lo) + 1 for lo, h in zip(keyed[1].tolist(), highs.tolist())], dtype=object
                        )
                    )
                    if len(rows)
                    else 0
                )
                lut = None
                if span <= 4 * len(rows) + 4096:  # a small key range: position by table lookup, no search
                    lut = np.full(span, -1, dtype=np.int64)
                    lut[sorted_keys] = np.arange(len(rows), dtype=np.int64)
                keys = (sorted_keys, keyed[1], highs, keyed[2], lut)
            self._rows.append(rows[order])
            self._keys.append(keys)
            self.texts.append(text)
            self.metas_by_row.append((tuple(shape), dtype))
            self._by_text.setdefault(text, []).append(r)
            bases.append(total)
            total += len(rows)
        self.bases = np.asarray(bases + [total], dtype=np.int64)
        self.row_numels = np.asarray(
            [int(np.prod(s, dtype=np.int64)) if s else 1 for s, _ in self.metas_by_row], dtype=np.int64
        )

    def ids(self, text: str, holes: np.ndarray) -> np.ndarray:
        return self.ids_numels(text, holes)[0]

    def ids_numels(self, text: str, holes) -> tuple[np.ndarray, np.ndarray]:
        """(id, numel) per row of integers of names of template `text` (a [n, k] matrix or `Columns`); id -1
        (numel 0) where no name matches."""
        holes = holes if isinstance(holes, Columns) else Columns.of(holes)
        n, k = holes.n, len(holes.arrays)
        out = np.full(n, -1, dtype=np.int64)
        numels = np.zeros(n, dtype=np.int64)
        for r in self._by_text.get(text, ()):
            todo = out < 0
            if not todo.any():
                break
            rows, keys = self._rows[r], self._keys[r]
            if k != rows.shape[1] or not len(rows):
                continue
            query = holes.arrays if todo.all() else [c[todo] for c in holes.arrays]
            m = len(query[0]) if k else int(todo.sum())
            if k == 0:
                pos = np.zeros(m, dtype=np.int64)
                found = np.full(m, len(rows) > 0)
            elif keys is None:
                lookup = {tuple(row): j for j, row in enumerate(rows.tolist())}
                pos = np.asarray([lookup.get(tuple(q), -1) for q in np.stack(query, axis=1).tolist()], dtype=np.int64)
                found = pos >= 0
            else:
                sorted_keys, lows, highs, mults, lut = keys
                in_range = np.ones(m, dtype=bool)
                qkeys = np.zeros(m, dtype=np.int64)
                for c, lo, hi, mult in zip(query, lows.tolist(), highs.tolist(), mults.tolist()):
                    in_range &= (c >= lo) & (c <= hi)
                    qkeys += (c - lo) * mult  # a key is injective only in range: `in_range` guards the rest
                qkeys = np.where(in_range, qkeys, 0)
                if lut is not None:
                    pos = lut[qkeys]
                    found = in_range & (pos >= 0)
                else:
                    pos = np.minimum(np.searchsorted(sorted_keys, qkeys), len(sorted_keys) - 1)
                    found = in_range & (sorted_keys[pos] == qkeys)
            ids = np.where(found, self.bases[r] + pos, -1)
            if todo.all():
                out, numels = ids, np.where(found, self.row_numels[r], 0)
            else:
                where = np.nonzero(todo)[0]
                out[where] = ids
                numels[where] = np.where(found, self.row_numels[r], 0)
        return out, numels

    def _row_of(self, i: int) -> int:
        return int(np.searchsorted(self.bases, i, side="right")) - 1

    def name(self, i: int) -> str:
        r = self._row_of(i)
        return Filler(self._rows[r][i - self.bases[r]].tolist()).name(self.texts[r])

    def meta(self, i: int) -> ir.TensorMeta:
        shape, dtype = self.metas_by_row[self._row_of(i)]
        return ir.TensorMeta(self.name(i), shape, dtype)

    def numels(self, ids: np.ndarray, table: Mapping[str, ir.TensorMeta] | None = None) -> np.ndarray:
        if table is not None and table is not self.table:
            return super().numels(ids, table)
        rows = np.searchsorted(self.bases, ids, side="right") - 1
        return self.row_numels[rows]

    def renamed(self, ids: np.ndarray, rename) -> np.ndarray:
        # per template row: `rename` applied to the row's text, the names' integers kept
        out = np.full(len(ids), -1, dtype=np.int64)
        if len(ids) > 1 and not (ids[1:] >= ids[:-1]).all():
            order = np.argsort(ids, kind="stable")
            out[order] = self.renamed(ids[order], rename)
            return out
        # sorted ids: each template row's ids are one slice
        cuts = np.searchsorted(ids, self.bases).tolist()
        for r, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
            other = rename(self.texts[r]) if hi > lo else None
            if other is not None:
                out[lo:hi] = self.ids(other, self._rows[r][ids[lo:hi] - self.bases[r]])
        return out

    def dtype_codes(self, ids: np.ndarray, table: Mapping[str, ir.TensorMeta]) -> tuple[np.ndarray, list[str]] | None:
        if table is not self.table:
            return None
        names = sorted({d for _, d in self.metas_by_row})
        code = {d: i for i, d in enumerate(names)}
        row_codes = np.asarray([code[d] for _, d in self.metas_by_row], dtype=np.int64)
        return row_codes[np.searchsorted(self.bases, ids, side="right") - 1], names

    def dtypes(self, ids: np.ndarray, table: Mapping[str, ir.TensorMeta] | None = None) -> list[str]:
        """dtype name per id (`table`: as the trainer's sources describe them; default: this table's)."""
        if table is not None and table is not self.table:
            return [table[self.name(int(i))].dtype for i in ids.tolist()]
        rows = (np.searchsorted(self.bases, ids, side="right") - 1).tolist()
        return [self.metas_by_row[r][1] for r in rows]


def table_ids(table) -> SourceIds:
    """The `SourceIds` of a source table, built once per table (cached on it)."""
    ids = getattr(table, "_shardplan_source_ids", None)
    if ids is None:
        ids = TableSourceIds(table)
        try:
            table._shardplan_source_ids = ids
        except AttributeError:
            pass
    return ids


# ---- the columns -----------------------------------------------------------------------------------------------
class WriteColumns:
    """One rank's writes as columns (see the module docstring). Build with `from_writes` or plan/file/rank.py."""

    def __init__(
        self,
        param_names: Sequence[str],
        param,
        dst_offset,
        dst_ndim,
        dst_sizes,
        dst_strides,
        src,
        src_offset,
        src_ndim,
        src_sizes,
        src_strides,
        computed: Mapping[int, ir.Write],
        sources: SourceIds,
        classes: Mapping[str, np.ndarray] | None = None,
        tables: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
    ):
        # `tables` (with `classes`): a side's geometry as (ndim, sizes, strides) per class, its per-write
        # `*_ndim/_sizes/_strides` left None: gathered only when asked (the hot consumers read classes)
        self.param_names = tuple(param_names)
        self.param = np.asarray(param, dtype=np.int64)
        self.dst_offset = np.asarray(dst_offset, dtype=np.int64)
        self.src = np.asarray(src, dtype=np.int64)
        self.src_offset = np.asarray(src_offset, dtype=np.int64)
        self._geometry: dict[tuple[str, int], np.ndarray] = {}
        self._tables = dict(tables or {})
        for side, ndim, sizes, strides in (
            ("dst", dst_ndim, dst_sizes, dst_strides),
            ("src", src_ndim, src_sizes, src_strides),
        ):
            if side not in self._tables:
                self._geometry.update(
                    {
                        (side, 0): np.asarray(ndim, dtype=np.int64),
                        (side, 1): _matrix(sizes, 1),
                        (side, 2): _matrix(strides, 0),
                    }
                )
        self.computed = dict(computed)
        self.sources = sources
        self._cache: dict = {}
        self._classes = dict(classes or {})

    def _side(self, side: str, k: int) -> np.ndarray:
        got = self._geometry.get((side, k))
        if got is None:
            got = self._geometry[(side, k)] = np.take(self._tables[side][k], self._classes[side], axis=0)
        return got

    dst_ndim = property(lambda self: self._side("dst", 0))
    dst_sizes = property(lambda self: self._side("dst", 1))
    dst_strides = property(lambda self: self._side("dst", 2))
    src_ndim = property(lambda self: self._side("src", 0))
    src_sizes = property(lambda self: self._side("src", 1))
    src_strides = property(lambda self: self._side("src", 2))

    def geometry_rows(self, side: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ndim, sizes, strides) of the `side` regions of the given writes (from the class tables when the columns
        have them: no per-write matrix is built)."""
        if (side, 1) not in self._geometry:
            ndim, sizes, strides = self._tables[side]
            klass = self._classes[side][rows]
            return ndim[klass], np.take(sizes, klass, axis=0), np.take(strides, klass, axis=0)
        return (
            self._side(side, 0)[rows],
            np.take(self._side(side, 1), rows, axis=0),
            np.take(self._side(side, 2), rows, axis=0),
        )

    def geometry_width(self, side: str) -> int:
        """Columns of the `side` sizes/strides matrices (the widest region, padded)."""
        return (self._tables[side][1] if (side, 1) not in self._geometry else self._geometry[(side, 1)]).shape[1]

    def region_classes(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """(class per write, a representative write per class) of the `side` ("dst"/"src") region geometry (ndim,
        sizes, strides): equal classes have equal geometry (equal geometries may still be two classes). From the
        templates when instantiated from a plan file (a template's geometry rarely varies), else computed."""
        key = ("classes", side)
        got = self._cache.get(key)
        if got is None:
            classes = self._classes.get(side)
            if classes is None:
                matrix = np.concatenate(
                    [
                        getattr(self, f"{side}_ndim")[:, None],
                        getattr(self, f"{side}_sizes"),
                        getattr(self, f"{side}_strides"),
                    ],
                    axis=1,
                )
                first, classes = distinct_rows(matrix)
            else:
                first = np.full(int(classes.max(initial=-1)) + 1, len(classes), dtype=np.int64)
                np.minimum.at(first, classes, np.arange(len(classes), dtype=np.int64))
                used = first < len(classes)
                if not used.all():  # renumber densely
                    remap = np.cumsum(used) - 1
                    classes, first = remap[classes], first[used]
            got = self._cache[key] = (classes, first)
        return got

    def __len__(self) -> int:
        return len(self.param)

    def written_params(self) -> tuple[str, ...]:
        """Names of the params the writes write, sorted."""
        written = np.flatnonzero(np.bincount(self.param, minlength=len(self.param_names)))  # no sort: O(writes)
        return tuple(sorted(self.param_names[i] for i in written.tolist()))

    def sources_of(self, i: int) -> tuple[str, ...]:
        """Names of the checkpoint tensors write i reads, sorted."""
        w = self.computed.get(i)
        return (self.source_name(i),) if w is None else tuple(sorted(ir.sources(w.src.leaf)))

    @property
    def pure(self) -> np.ndarray:
        """Bool per write: a pure view of one checkpoint tensor (replayed with zero ops)."""
        return self.src >= 0

    @classmethod
    def from_writes(
        cls,
        params: Sequence[ir.TensorMeta] | Sequence[str],
        writes: Sequence[ir.Write],
        sources: SourceIds | None = None,
    ) -> "WriteColumns":
        names = tuple(p if isinstance(p, str) else p.name for p in params)
        index = {n: i for i, n in enumerate(names)}
        extra = sorted({w.param for w in writes} - set(index))
        names += tuple(extra)  # writes to params the plan does not declare: the consumers' checks name them
        index.update({n: len(index) + i for i, n in enumerate(extra)})
        if sources is None:
            sources = NameSourceIds(sorted({w.src.leaf.name for w in writes if ir.is_pure_view(w)}))
        width = max(
            [len(w.dst.sizes) for w in writes] + [len(w.src.region.sizes) for w in writes if ir.is_pure_view(w)] + [1]
        )
        n = len(writes)
        cols = {
            k: np.zeros(n, dtype=np.int64) for k in ("param", "dst_offset", "dst_ndim", "src", "src_offset", "src_ndim")
        }
        mats = {
            k: np.full((n, width), 1 if k.endswith("sizes") else 0, dtype=np.int64)
            for k in ("dst_sizes", "dst_strides", "src_sizes", "src_strides")
        }
        computed = {}
        pure_names = []
        for i, w in enumerate(writes):
            cols["param"][i] = index[w.param]
            _put(cols, mats, "dst", i, w.dst)
            if ir.is_pure_view(w):
                pure_names.append((i, w.src.leaf.name))
                _put(cols, mats, "src", i, w.src.region)
            else:
                computed[i] = w
                cols["src"][i] = -1
        if pure_names:
            cols["src"][[i for i, _ in pure_names]] = sources.ids_of_names(n for _, n in pure_names)
        return cls(
            names,
            cols["param"],
            cols["dst_offset"],
            cols["dst_ndim"],
            mats["dst_sizes"],
            mats["dst_strides"],
            cols["src"],
            cols["src_offset"],
            cols["src_ndim"],
            mats["src_sizes"],
            mats["src_strides"],
            computed,
            sources,
        )

    # -- one write back as objects (cached: regions and names repeat) --
    def _region(self, side: str, i: int) -> ir.Region:
        if (side, 1) in self._geometry:  # per-write matrices exist (built, or gathered by a property: maybe not all)
            ndim = int(self._side(side, 0)[i])
            geometry = (tuple(self._side(side, 1)[i, :ndim].tolist()), tuple(self._side(side, 2)[i, :ndim].tolist()))
        else:  # per class, kept
            klass = ("class", side, int(self._classes[side][i]))
            geometry = self._cache.get(klass)
            if geometry is None:
                ndim, sizes, strides = (t[klass[2]] for t in self._tables[side])
                geometry = self._cache[klass] = (
                    tuple(sizes[: int(ndim)].tolist()),
                    tuple(strides[: int(ndim)].tolist()),
                )
        key = (side, int(getattr(self, f"{side}_offset")[i])) + geometry
        region = self._cache.get(key)
        if region is None:
            region = self._cache[key] = ir.Region(key[1], key[2], key[3])
        return region

    def dst(self, i: int) -> ir.Region:
        return self._region("dst", i)

    def source_name(self, i: int) -> str:
        key = ("s", int(self.src[i]))
        name = self._cache.get(key)
        if name is None:
            name = self._cache[key] = self.sources.name(key[1])
        return name

    def write(self, i: int) -> ir.Write:
        w = self.computed.get(i)
        if w is not None:
            return w
        return ir.Write(
            self.param_names[self.param[i]],
            self.dst(i),
            ir.View(ir.Source(self.source_name(i)), self._region("src", i)),
        )


def _matrix(values, pad: int) -> np.ndarray:
    m = np.asarray(values, dtype=np.int64)
    return m.reshape(len(m), -1) if m.ndim != 2 else m


def _put(cols: dict, mats: dict, side: str, i: int, region: ir.Region) -> None:
    cols[f"{side}_offset"][i] = region.offset
    cols[f"{side}_ndim"][i] = len(region.sizes)
    mats[f"{side}_sizes"][i, : len(region.sizes)] = region.sizes
    mats[f"{side}_strides"][i, : len(region.strides)] = region.strides


class LazyWrites(Sequence):
    """`RankPlan.writes` of a columnar plan: `ir.Write` objects are built when indexed or iterated (and kept)."""

    def __init__(self, columns: WriteColumns):
        self.columns = columns
        self._all: tuple[ir.Write, ...] | None = None

    def __len__(self) -> int:
        return len(self.columns)

    def materialise(self) -> tuple[ir.Write, ...]:
        if self._all is None:
            self._all = tuple(self.columns.write(i) for i in range(len(self.columns)))
        return self._all

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.materialise()[i]
        if self._all is not None:
            return self._all[i]
        n = len(self.columns)
        if not -n <= i < n:
            raise IndexError(f"write {i} of a plan with {n} writes")
        return self.columns.write(i % n)

    def __iter__(self) -> Iterator[ir.Write]:
        return iter(self.materialise())

    def __eq__(self, other) -> bool:
        if isinstance(other, LazyWrites):
            other = other.materialise()
        try:
            return len(other) == len(self) and self.materialise() == tuple(other)
        except TypeError:
            return NotImplemented

    def __hash__(self) -> int:
        return hash(self.materialise())

    def __repr__(self) -> str:
        return f"LazyWrites({len(self)} writes)"

    def __add__(self, other):
        return self.materialise() + tuple(other)

    def __radd__(self, other):
        return tuple(other) + self.materialise()


def columns_of(plan: ir.RankPlan) -> WriteColumns:
    """The plan's writes as columns: the plan's own when it was instantiated columnar, else built from its
    `ir.Write` objects (once per plan object: cached)."""
    writes = plan.writes
    if isinstance(writes, LazyWrites):
        return writes.columns
    key = id(plan)
    got = _OBJECT_COLUMNS.get(key)
    if got is not None and got[0] is plan:
        return got[1]
    cols = WriteColumns.from_writes(plan.params, writes)
    if len(_OBJECT_COLUMNS) > 64:
        _OBJECT_COLUMNS.pop(next(iter(_OBJECT_COLUMNS)))
    _OBJECT_COLUMNS[key] = (plan, cols)
    return cols


_OBJECT_COLUMNS: dict[int, tuple] = {}
