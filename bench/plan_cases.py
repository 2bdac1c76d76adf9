"""Benchmark cases from recorded plan files (plans/*.plan): one decoder layer of one consumer rank.

Shaped like the benches' PlanBuilder (`.plan()`, `.params`, `.writes`, `.sources`), so a real recorded plan can replace
the synthesized ones: `--cases plan=plans/kimi-k2--tp32-ep--bfloat16.plan` (replay_bench, sync_bench).
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from shardplan.plan import ir  # noqa: E402  # noqa: E402
from shardplan.plan.file.format import PlanFile  # noqa: E402


@functools.cache
def _plan_file(path: str) -> PlanFile:
    return PlanFile.read(path)


class PlanLayer:
    """Writes of `rank` into decoder layer `layer` (params named `...layers.<layer>.`), and the sources they read."""

    def __init__(self, path: str, rank: int, layer: int):
        plan_file = _plan_file(path)
        full = plan_file.rank(rank)
        key = f"layers.{layer}."
        self.rank = rank
        self.writes = [w for w in full.writes if key in w.param]
        names = {w.param for w in self.writes}
        self.params = {p.name: p for p in full.params if p.name in names}
        read: set[str] = set()
        for w in self.writes:
            ir.sources(w.src.leaf, read)
        self.sources = {n: plan_file.sources[n] for n in sorted(read)}
        self.label = f"{os.path.basename(path).removesuffix('.plan')} layer {layer} rank {rank} (recorded)"

    def plan(self) -> ir.RankPlan:
        return ir.RankPlan(self.rank, tuple(self.params.values()), tuple(self.writes))
