"""record/figures.py counts every rank's figures from the templated body at once; they must equal the figures of each
rank's instantiated plan (checkpoint tensors read, fallbacks, bytes received), with and without layer multiplicity."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from plan_worlds import plan_file_of, worlds

from shardplan.plan import ir
from shardplan.plan.file.format import PlanBoundsError, PlanFile, PlanFileError
from shardplan.plan.names import layer_of
from shardplan.record import figures as figures_module
from shardplan.record.figures import rank_figures

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANS = (
    "llama-3.1-8b--tp2--bfloat16",
    "kimi-k2--tp32-ep--bfloat16",
    "qwen3-30b-a3b--tp4--bfloat16",
    "gpt-oss-120b--tp8-ep--bfloat16",
)


def _reference(plan_file: PlanFile, rank: int, mult: dict) -> tuple[int, int, int]:
    plan = plan_file.rank(rank)
    params = {p.name: p for p in plan.params}
    num_read = sum(mult.get(layer_of(name), 1) for name in plan.sources_read())
    nbytes = sum(w.dst.numel * ir.itemsize(params[w.param].dtype) * mult.get(layer_of(w.param), 1) for w in plan.writes)
    sources = plan_file.body.sources
    nbytes += sum(sources[f.source].numel * ir.itemsize(sources[f.source].dtype) for f in plan.fallbacks)
    return num_read, len(plan.fallbacks), nbytes


@pytest.mark.parametrize("name", PLANS)
def test_rank_figures_equal_each_ranks_plan(name):
    plan_file = PlanFile.read(os.path.join(ROOT, "plans", f"{name}.plan"))
    ranks = plan_file.ranks
    _check(plan_file, sorted({ranks[0], ranks[len(ranks) // 2], ranks[-1]}))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_rank_figures_of_random_plans(world):
    """Random plans have what the shipped ones lack: ordered (overlapping) writes, computed writes. (No layer
    multiplicity here: a random plan's non-layer params read layer tensors, which a recording's cut model never
    does; the figures weigh such reads by the param's layer variable.)"""
    plans, sources = world
    try:
        plan_file = plan_file_of([ir.RankPlan(i, p.params, p.writes) for i, p in enumerate(plans)], sources)
    except PlanFileError:
        assume(False)
    try:
        for rank in plan_file.ranks:
            plan_file.rank(rank)
    except PlanBoundsError:  # e.g. a generated constant fill larger than its param: the reader refuses the rank
        assume(False)
    _check(plan_file, plan_file.ranks, ({},))


def _check(plan_file: PlanFile, ranks, mults=({}, {0: 0, 1: 3, 2: 5, 3: 2, 7: 4})) -> None:
    for mult in mults:
        figures = rank_figures(plan_file.body, mult)
        assert sorted(figures) == sorted(plan_file.ranks)
        for rank in ranks:
            assert figures[rank] == _reference(plan_file, rank, mult), (rank, mult)
        # the ranks are counted in chunks of about CHUNK_ROWS rows (memory flat in the number of ranks): one rank per
        # chunk counts the same
        default, figures_module.CHUNK_ROWS = figures_module.CHUNK_ROWS, 1
        try:
            assert rank_figures(plan_file.body, mult) == figures, mult
        finally:
            figures_module.CHUNK_ROWS = default
