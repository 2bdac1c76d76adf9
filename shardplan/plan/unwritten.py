"""Elements of a rank's params that none of its plan's writes defines (docs/configs.md, "Bytes no checkpoint tensor
defines"): padding vLLM allocates per rank (Kimi-Linear's expert intermediate at TP > 1 without EP) that its own
loader never writes either. Derived from the writes and the param shapes alone, so a consumer can zero them.

    unwritten_ranges(plan) -> {param: [(lo, hi), ...]}   flat element ranges of the contiguous param, sorted, disjoint
    unwritten_runs(written_mask) -> [(lo, hi), ...]     the same ranges from a flat mask of written elements

Only params the plan writes are listed (one it never writes is another matter: the engine refuses it). A write whose
destination is one contiguous run is an interval; any other region is marked element by element on a boolean mask of
its param (numpy, no copy of the param's data).
"""

from __future__ import annotations

import numpy as np

from shardplan.plan import ir


def _gaps(runs: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in sorted(runs):
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < numel:
        out.append((at, numel))
    return out


def unwritten_runs(written: np.ndarray) -> list[tuple[int, int]]:
    """(lo, hi) of each run of False in a flat boolean mask of written elements (also what `shardplan verify` and the
    coverage sweep derive from the elements vLLM's loader leaves NaN-poisoned)."""
    edges = np.flatnonzero(np.diff(np.concatenate(([1], written.view(np.int8), [1]))))
    return [(int(lo), int(hi)) for lo, hi in zip(edges[::2], edges[1::2])]


def unwritten_ranges(plan: ir.RankPlan) -> dict[str, list[tuple[int, int]]]:
    """Per written param, the element ranges no write of `plan` covers (params fully covered are left out)."""
    numel = {p.name: int(np.prod(p.shape, dtype=np.int64)) for p in plan.params}
    runs: dict[str, list[tuple[int, int]]] = {}
    strided: dict[str, list[ir.Region]] = {}
    for w in plan.writes:
        if not w.dst.numel:
            continue
        lo, hi = w.dst.extent()
        if hi - lo == w.dst.numel:  # one contiguous run (a region cannot touch an element twice: it is written)
            runs.setdefault(w.param, []).append((lo, hi))
        else:
            strided.setdefault(w.param, []).append(w.dst)
    out = {}
    for name in sorted(set(runs) | set(strided)):
        gaps = _gaps(runs.get(name, []), numel[name])
        if gaps and name in strided:
            mask = np.zeros(numel[name], dtype=bool)
            for lo, hi in runs.get(name, []):
                mask[lo:hi] = True
            for r in strided[name]:
                itemsize = mask.itemsize
                view = np.lib.stride_tricks.as_strided(
                    mask[r.offset :], shape=r.sizes, strides=[s * itemsize for s in r.strides], writeable=True
                )
                view[...] = True
            gaps = unwritten_runs(mask)
        if gaps:
            out[name] = gaps
    return out
