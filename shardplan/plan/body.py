"""The in-memory plan: `PlanBody` (what a plan file holds after its header, decoded but still templated), its
templated `Group`s of writes, the templated checkpoint `SourceTable`, and `instantiate(body, rank)`, one rank's
`ir.RankPlan` built write by write.

The compiler (plan/compile/) makes a body from recordings, the plan file (plan/file/) encodes, decodes and checks one,
and instantiates a rank as columns (plan/file/rank.py) equal to `instantiate` write for write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from shardplan.plan import ir
from shardplan.plan.template import (
    Filler,
    build_trie,
    iter_trie,
    split_name,
    trie_child,
    trie_count,
)


# ---- templated writes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    skeleton: tuple
    coeffs: np.ndarray  # int64 [num_holes, 1 + num_vars]: hole = coeffs[:, 0] + coeffs[:, 1:] @ vars
    index: tuple  # trie over var tuples (rank first)
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
            text = split_name(m.name, ints)
            rows.setdefault((text, tuple(m.shape), m.dtype), []).append(tuple(ints))
        return cls([(t, s, d, build_trie(sorted(set(v)))) for (t, s, d), v in rows.items()])

    def __getitem__(self, name: str) -> ir.TensorMeta:
        ints: list[int] = []
        text = split_name(name, ints)
        for shape, dtype, index in self._by_text.get(text, ()):
            if (index is None and not ints) or (index is not None and _trie_has(index, ints)):
                return ir.TensorMeta(name, shape, dtype)
        raise KeyError(name)

    def _materialise(self) -> list[str]:
        if self._names is None:
            names = []
            for text, _, _, index in self.templates:
                if index is None:
                    names.append(Filler(()).name(text))
                else:
                    names.extend(Filler(t).name(text) for t in iter_trie(index))
            self._names = sorted(names)
        return self._names

    def __iter__(self):
        return iter(self._materialise())

    def __len__(self) -> int:
        return sum(trie_count(index) for _, _, _, index in self.templates)


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
    params: dict[str, ir.TensorMeta]  # union over ranks: one meta per name, the one most ranks have
    rank_params: dict[int, tuple[str, ...]]
    groups: list[Group]
    ordered: dict[int, list[ir.Write]]  # per rank, recording order (overlapping destinations)
    fallbacks: dict[int, list[ir.Fallback]]
    not_needed: dict[int, tuple[str, ...]]
    # ranks whose param of that name has another shape than `params` says: uneven expert parallelism (384 experts
    # over 256 EP ranks: ranks 0-127 stack 2 local experts in w13_weight, ranks 128-255 one)
    rank_metas: dict[int, dict[str, ir.TensorMeta]] = field(default_factory=dict)

    def meta(self, rank: int, name: str) -> ir.TensorMeta:
        """Param `name` as rank `rank` declares it."""
        override = self.rank_metas.get(rank)
        return override[name] if override and name in override else self.params[name]

    def num_writes(self, rank: int | None = None) -> int:
        if rank is None:
            total = sum(trie_count(g.index) for g in self.groups)
        else:
            total = sum(trie_count(child) for g in self.groups if (child := trie_child(g.index, rank)) is not None)
        ranks = self.ranks if rank is None else (rank,)
        return total + sum(len(self.ordered.get(r, ())) for r in ranks)


def split_metas(
    by_rank: Mapping[int, Iterable[ir.TensorMeta]],
) -> tuple[dict[str, ir.TensorMeta], dict[int, dict[str, ir.TensorMeta]]]:
    """(one meta per param name: the one most ranks declare, the smallest on a tie; per rank, the metas that differ
    from it). Canonical: independent of rank order, so recording and decoding agree."""
    shared: dict[int, tuple[object, int]] = {}  # ranks of a layout mostly share one list object: count it once
    for metas in by_rank.values():
        seen = shared.get(id(metas))
        shared[id(metas)] = (metas, 1 + (seen[1] if seen else 0))
    counts: dict[str, dict[ir.TensorMeta, int]] = {}
    for metas, num_ranks in shared.values():
        for m in metas:
            variants = counts.setdefault(m.name, {})
            variants[m] = variants.get(m, 0) + num_ranks
    params = {
        n: next(iter(v)) if len(v) == 1 else min(v, key=lambda m: (-v[m], m.shape, m.dtype)) for n, v in counts.items()
    }
    rank_metas: dict[int, dict[str, ir.TensorMeta]] = {}
    if any(len(v) > 1 for v in counts.values()):
        differing: dict[int, dict[str, ir.TensorMeta]] = {}
        for rank, metas in by_rank.items():
            if id(metas) not in differing:
                differing[id(metas)] = {m.name: m for m in metas if m != params[m.name]}
            if differing[id(metas)]:
                rank_metas[rank] = differing[id(metas)]
    return params, rank_metas
