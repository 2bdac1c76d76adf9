"""Trainer-side cost of EPLB per consumer rank and placement, next to instantiating the rank's plan in the same run.

    python bench/eplb_bench.py PLAN [--rank 5] [--repeat 5]

PLAN: a plan recorded with `shardplan record ... --ep --eplb-redundant R`. Times (process CPU time, best of --repeat):
  instantiate: PlanFile.rank(rank) on a fresh PlanFile (what every sync setup pays once; the baseline)
  make:        make_placement of a random [moe_layers, E + R] map (checks shape and values; per placement)
  alias:       with_slot_aliases for every slot of the rank (what EplbPacker does, per group, at every sync)
  bind:        PlacementBinder.bind (a bound RankPlan, for the reference interpreter; cached by digest)

    python bench/eplb_bench.py PLAN --schedule-trainers 8 [--repeat 3]

The driver's side for expert-parallel trainers (each of N ranks holds E / N experts whole and every other tensor):
  schedule (whole trainers): build_schedule over every consumer's spans, trainers holding everything (the baseline:
               computed once per membership, whatever the placement)
  schedule per placement:    what Coordinator.announce adds at each new set of placements: every consumer's slot spans
               bound to a random placement, then build_schedule with each trainer's experts (cached per placements)
"""

from __future__ import annotations

import argparse
import random
import time

from shardplan.plan.file.format import PlanFile
from shardplan.plan.names import slot_of
from shardplan.plan.placement import PlacementBinder, make_placement, with_slot_aliases


def best(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        times.append(time.process_time() - t)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--rank", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--schedule-trainers", type=int, default=0, help="also time the per-placement schedule")
    args = ap.parse_args()
    slots = PlanFile.read(args.plan).header.eplb
    if slots is None:
        raise SystemExit(f"{args.plan} has no EPLB slots: record it with --eplb-redundant R")
    t_inst, plan = best(lambda: PlanFile.read(args.plan).rank(args.rank), args.repeat)
    rng = random.Random(0)
    rows = []
    for _ in slots.moe_layers:
        row = list(range(slots.num_logical_experts)) + [
            rng.randrange(slots.num_logical_experts) for _ in range(slots.num_redundant_experts)
        ]
        rng.shuffle(row)
        rows.append(row)
    t_make, placement = best(lambda: make_placement(rows, slots), args.repeat)
    slot_names = sorted(n for n in plan.sources_read() if slot_of(n) is not None)
    bound = PlacementBinder(plan, slots).bind(placement)
    tensors = {n: object() for n in bound.sources_read()}
    t_alias, _ = best(lambda: with_slot_aliases(tensors, slot_names, placement), args.repeat)
    t_bind, _ = best(lambda: PlacementBinder(plan, slots).bind(placement), args.repeat)
    print(
        f"{args.plan} rank {args.rank}: {len(plan.writes)} writes, {len(slot_names)} slot writes; "
        f"E={slots.num_logical_experts} R={slots.num_redundant_experts} EP={slots.num_ep_ranks} "
        f"{len(slots.moe_layers)} MoE layers"
    )
    print(f"  instantiate (baseline) {t_inst * 1e3:8.1f} ms")
    for name, t in (("make_placement", t_make), ("alias every slot", t_alias), ("bind", t_bind)):
        print(f"  {name:<22} {t * 1e3:8.1f} ms   {t / t_inst:5.2f}x instantiate")
    if args.schedule_trainers:
        schedule(args.plan, slots, placement, args.schedule_trainers, args.repeat)


def schedule(path: str, slots, placement, num_trainers: int, repeat: int) -> None:
    from shardplan.plan.names import expert_of
    from shardplan.runtime.shards import ep_shards
    from shardplan.sync import spans_of
    from shardplan.sync.placement import EplbPacker, SlotSpans
    from shardplan.sync.schedule import build_schedule

    plan_file = PlanFile.read(path)
    t0 = time.perf_counter()
    packer = EplbPacker([plan_file.rank(r) for r in plan_file.ranks], plan_file.sources, slots)
    spans = spans_of(packer)
    eplb = SlotSpans(slots, spans_of(packer.inner))
    t_init = time.perf_counter() - t0
    consumers, trainers, groups = sorted(spans), tuple(range(num_trainers)), packer.groups()
    needed = {n for by_group in spans.values() for ss in by_group.values() for s in ss for n in s.sources}
    needed |= eplb.experts
    real = {n: m for n, m in plan_file.sources.items() if slot_of(n) is None}
    held: dict[int, set[str]] = {t: set() for t in trainers}
    for s in ep_shards(real, num_trainers, expert_of, slots.num_logical_experts):
        if s.name in needed:
            held[s.rank].add(s.name)
    held = {t: frozenset(h) for t, h in held.items()}
    assert eplb.placement_matters(held)
    t_whole, _ = best(lambda: build_schedule(spans, groups, {t: None for t in trainers}, trainers, consumers), repeat)

    def per_placement():
        bound = {c: eplb.bound(c, placement) for c in consumers}
        return build_schedule(bound, groups, held, trainers, consumers)

    t_placed, sched = best(per_placement, repeat)
    print(
        f"  driver init (EplbPacker over {len(consumers)} ranks + spans, wall) {t_init:6.1f} s; "
        f"{num_trainers} expert-parallel trainers"
    )
    print(f"  schedule, whole trainers (baseline, once) {t_whole * 1e3:8.1f} ms")
    print(
        f"  schedule per placement                   {t_placed * 1e3:8.1f} ms   {t_placed / t_whole:5.2f}x baseline; "
        f"schedule JSON {len(sched.to_json()) / 2**20:.1f} MiB; bytes per trainer "
        f"{[round(b / 2**30, 1) for b in sched.bytes_by_trainer().values()]} GiB"
    )


if __name__ == "__main__":
    main()
