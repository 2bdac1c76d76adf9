"""What the coordinator of a simulated sync sees: every consumer's segments per weight group, exactly as the engine's
Packer reports them, and which trainer holds what; `Workload.schedule()` hands them to the real `build_schedule`.

Two kinds of trainer, as in the engine:
  * `whole_tensors`: trainers hold checkpoint tensors whole (replicas, or a WeightSource that gathers per group):
    the spans are `ReplayPacker.spans`' (PackLayout with layers moved in parts of `sync.PART_BYTES`);
  * `sharded`: trainers hold boxes (shardplan.runtime.shards); `plan_shards` pins every piece to one trainer and the
    spans are `ShardedPacker.spans`' (whole layers, each trainer's part aligned, in trainer order). Consecutive segments
    pinned to the same trainer are merged into one: the schedule builder cuts a run of segments with the same
    eligible trainers into ceil(#trainers / #consumers) chunks but never more chunks than eligible trainers, so a
    pinned run is one piece either way (tests/unit/test_simulate.py checks the pieces are the same).

Building a fleet's workload costs what the coordinator would pay at start-up, in Python (`plan_shards` per consumer
rank), so `layers=` restricts the plans to some decoder layers (the
simulator then reports the layers it ran; extrapolate.py turns two such runs into a full-model estimate).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from shardplan.plan import ir
from shardplan.plan.file.format import PlanFile
from shardplan.plan.names import group_layer, group_of, group_order, is_scale, weight_of_scale
from shardplan.runtime.pack import PackLayout, fallback_slots, sharded_bases
from shardplan.runtime.shards import ShardError, TrainerShard, UncoveredSourceError, plan_shards
from shardplan.simulate.fleet import CoverageError, FleetError
from shardplan.sync import PART_BYTES, Schedule, ScheduleError, Span, build_schedule

ALIGNMENT = 256  # the engine's default pack alignment (ReplayPacker / ShardedPacker)


@dataclass
class Workload:
    """Every consumer's segments per group (`layouts[c][group]`, what Packer.spans reports), the groups in sync
    order, the trainer ranks and what each holds whole (`held[t]`: None = everything)."""

    groups: tuple[str, ...]
    layouts: dict[int, dict[str, tuple[Span, ...]]]
    trainers: tuple[int, ...]
    held: dict[int, frozenset[str] | None]
    plan_rank: dict[int, int]  # consumer rank -> the plan rank it runs (replicas share plans)
    description: str
    build_seconds: float = 0.0
    layers: tuple[int, ...] | None = None  # the decoder layers kept (None: the whole model)
    num_layers: int = 0  # decoder layers of the whole model
    notes: list[str] = field(default_factory=list)

    @property
    def consumers(self) -> tuple[int, ...]:
        return tuple(sorted(self.layouts))

    def consumer_bytes(self) -> dict[int, int]:
        return {c: sum(s.nbytes for segs in lay.values() for s in segs) for c, lay in self.layouts.items()}

    def schedule(self) -> Schedule:
        """The real schedule builder on this workload; a byte no trainer holds is a CoverageError."""
        try:
            return build_schedule(self.layouts, self.groups, self.held, self.trainers, self.consumers)
        except ScheduleError as e:
            raise CoverageError(f"{self.description}: {e}") from e


def restrict(plan: ir.RankPlan, layers: Iterable[int] | None, rank: int | None = None) -> ir.RankPlan:
    """The plan's writes to the given decoder layers only (None: all), renumbered as consumer `rank`."""
    rank = plan.rank if rank is None else rank
    if layers is None:
        return plan if rank == plan.rank else ir.RankPlan(rank, plan.params, plan.writes, plan.fallbacks)
    keep = {f"layers.{i}" for i in layers}
    writes = tuple(w for w in plan.writes if group_of(w.param) in keep)
    written = {w.param for w in writes}
    return ir.RankPlan(
        rank,
        tuple(p for p in plan.params if p.name in written),
        writes,
        tuple(f for f in plan.fallbacks if group_of(f.source) in keep),
    )


def num_decoder_layers(plan_file: PlanFile) -> int:
    return 1 + max((group_layer(g) for g in map(group_of, plan_file.sources)), default=-1)


def _consumer_ranks(plan_file: PlanFile, ranks: Sequence[int] | None, replicas: int) -> dict[int, int]:
    """consumer rank -> plan rank: `replicas` copies of the layout (inference data parallelism), replica k's rank r
    being consumer k * world + r."""
    if replicas < 1:
        raise FleetError(f"replicas must be >= 1, got {replicas}")
    world = plan_file.header.layout.world_size
    ranks = list(plan_file.ranks if ranks is None else ranks)
    missing = [r for r in ranks if r not in plan_file.ranks]
    if missing:
        raise FleetError(f"{plan_file.path}: no plan for ranks {missing} (the file covers {list(plan_file.ranks)})")
    return {k * world + r: r for k in range(replicas) for r in ranks}


def whole_tensors(
    plan_file: PlanFile,
    *,
    num_trainers: int = 1,
    replicas: int = 1,
    ranks: Sequence[int] | None = None,
    held: Mapping[int, frozenset[str] | None] | None = None,
    layers: Iterable[int] | None = None,
    part_bytes: int | None = PART_BYTES,
) -> Workload:
    """Trainers 0..num_trainers-1 holding whole checkpoint tensors (`held[t]`, default: all of them)."""
    start = time.perf_counter()
    layers = None if layers is None else tuple(sorted(set(layers)))
    plan_rank = _consumer_ranks(plan_file, ranks, replicas)
    sources = plan_file.sources
    per_rank: dict[int, dict[str, tuple[Span, ...]]] = {}
    for r in sorted(set(plan_rank.values())):
        plan = restrict(plan_file.rank(r), layers)
        layout = PackLayout.from_plans(plan, ALIGNMENT, part_bytes)
        groups: dict[str, list[Span]] = {}
        for span in layout.groups:
            segs = groups.setdefault(span.name, [])
            for s in layout.segments[span.first : span.last]:
                names = ir.sources(plan.writes[s.refs[0].index].src.leaf)
                segs.append(Span(s.offset - span.start, s.nbytes, tuple(sorted(names))))
        for group, slots in fallback_slots(plan, layout, sources).items():
            groups.setdefault(group, []).extend(Span(f.offset, f.nbytes, (f.name,)) for f in slots)
        per_rank[r] = {g: tuple(segs) for g, segs in groups.items()}
    layouts = {c: per_rank[r] for c, r in plan_rank.items()}
    all_groups = tuple(sorted({g for lay in per_rank.values() for g in lay}, key=group_order))
    trainers = tuple(range(num_trainers))
    held = {t: (None if held is None else held.get(t)) for t in trainers}
    return Workload(
        all_groups,
        layouts,
        trainers,
        held,
        plan_rank,
        f"{plan_file.header.model} {plan_file.header.layout.tag()} x{replicas} from {num_trainers} "
        f"trainer(s) holding whole tensors",
        time.perf_counter() - start,
        layers,
        num_decoder_layers(plan_file),
    )


def sharded(
    plan_file: PlanFile,
    shards: Sequence[TrainerShard],
    *,
    replicas: int = 1,
    ranks: Sequence[int] | None = None,
    layers: Iterable[int] | None = None,
    description: str = "sharded trainers",
) -> Workload:
    """Trainers holding boxes: `plan_shards` gives every piece to one trainer, as ShardedPacker does."""
    start = time.perf_counter()
    layers = None if layers is None else tuple(sorted(set(layers)))
    plan_rank = _consumer_ranks(plan_file, ranks, replicas)
    base = {r: plan_file.rank(r) for r in sorted(set(plan_rank.values()))}
    plans = [restrict(base[r], layers, rank=c) for c, r in sorted(plan_rank.items())]
    needed = set().union(*(p.sources_read() for p in plans)) if plans else set()
    sources = {n: plan_file.sources[n] for n in sorted(needed)}  # a dict: plan_shards looks every name up
    quantizer = plan_file.header.quantizer
    if quantizer:  # BF16 trainers of a block-FP8 plan hold no scales: each makes its boxes' (runtime.shards)
        shards = [s for s in shards if not (is_scale(s.name) and weight_of_scale(s.name) in plan_file.sources)]
    try:
        sharded_plan = plan_shards(plans, sources, shards, quantizer=quantizer)
    except UncoveredSourceError as e:
        raise CoverageError(f"trainer layout ({description}) does not cover every byte the consumers need: {e}") from e
    except ShardError as e:
        raise CoverageError(f"trainer layout ({description}) cannot serve the consumers: {e}") from e
    if any(p.fallbacks for p in plans):
        raise CoverageError(
            f"{plan_file.path}: plans with fallback tensors cannot be served by sharded trainers "
            f"(ShardedPacker ships replayed bytes only)"
        )
    by_consumer: dict[int, dict[int, ir.RankPlan]] = {}
    for (t, c), sub in sharded_plan.plans.items():
        by_consumer.setdefault(c, {})[t] = sub
    layout_cache: dict[tuple, PackLayout] = {}
    layouts: dict[int, dict[str, tuple[Span, ...]]] = {}
    for c in sorted(plan_rank):
        parts = {}
        for t, sub in sorted(by_consumer.get(c, {}).items()):
            key = (sub.params, sub.writes)
            if key not in layout_cache:
                layout_cache[key] = PackLayout.from_plans(ir.RankPlan(0, sub.params, sub.writes), ALIGNMENT)
            parts[t] = layout_cache[key]
        layouts[c] = _merged_spans(parts)
    all_groups = tuple(sorted({g for lay in layouts.values() for g in lay}, key=group_order))
    trainers = tuple(sorted({s.rank for s in shards}))
    return Workload(
        all_groups,
        layouts,
        trainers,
        {t: frozenset() for t in trainers},
        plan_rank,
        f"{plan_file.header.model} {plan_file.header.layout.tag()} x{replicas} from {description}",
        time.perf_counter() - start,
        layers,
        num_decoder_layers(plan_file),
    )


def _merged_spans(parts: Mapping[int, PackLayout]) -> dict[str, tuple[Span, ...]]:
    """ShardedPacker.spans for one consumer (each trainer's part of a group at its `sharded_bases` offset), with each
    trainer's segments of a group merged into one span (see the module docstring)."""
    out: dict[str, list[Span]] = {}
    for group in {g for lay in parts.values() for g in lay.group_names}:
        for t, base in sharded_bases(parts, group, ALIGNMENT).items():
            nonzero = [s for s in parts[t].group(group).segments if s.nbytes]
            if nonzero:
                lo, hi = nonzero[0].offset, nonzero[-1].offset + nonzero[-1].nbytes
                out.setdefault(group, []).append(Span(base + lo, hi - lo, (), (t,)))
    return {g: tuple(spans) for g, spans in out.items()}
