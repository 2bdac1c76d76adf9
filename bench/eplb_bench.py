"""Trainer-side cost of EPLB per consumer rank and placement, next to instantiating the rank's plan in the same run.

    python bench/eplb_bench.py PLAN [--rank 5] [--repeat 5]

PLAN: a plan recorded with `shardplan record ... --ep --eplb-redundant R`. Times (process CPU time, best of --repeat):
  instantiate: PlanFile.rank(rank) on a fresh PlanFile (what every sync setup pays once; the baseline)
  make:        make_placement of a random [moe_layers, E + R] map (checks shape and values; per placement)
  alias:       with_slot_aliases for every slot of the rank (what EplbPacker does, per group, at every sync)
  bind:        PlacementBinder.bind (a bound RankPlan, for the reference interpreter; cached by digest)
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


if __name__ == "__main__":
    main()
