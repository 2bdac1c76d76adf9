"""Trainer-rank host memory: a recorded plan vs SGLang P2P's per-rank engine replica (docs/sglang.md).

SGLang's P2P weight update (miles) builds, on the trainer, a CPU replica of each target engine rank with SGLang's
loader to learn which bytes that rank holds: every parameter of the rank, in host memory. With a plan the trainer
holds the plan (its file, and the rank's instantiated writes) and stages one layer of the rank's bytes at a time (the
sync engine's pipelining unit; with its 256 MiB part cap, less). Everything is computed from real plan files.

    .venv-sglang/bin/python bench/sglang_memory.py plans/kimi-k2--tp16-sglang--bfloat16.plan ... [--ranks 0,-1]
"""

from __future__ import annotations

import argparse
import os
import tracemalloc

from shardplan.plan import ir
from shardplan.plan.file.format import PlanFile
from shardplan.plan.inspect import human_bytes
from shardplan.runtime.pack import PackLayout

PART = 256 << 20  # the sync engine's part cap (sync/, docs/transports.md)


def rank_figures(path: str, rank: int) -> dict:
    tracemalloc.start()
    plan_file = PlanFile.read(path)
    plan = plan_file.rank(rank)
    plan_host = tracemalloc.get_traced_memory()[1]  # peak while reading the file and instantiating the rank
    tracemalloc.stop()
    replica = sum(ir.itemsize(m.dtype) * _numel(m.shape) for m in plan.params)
    layout = PackLayout.from_plans(plan)
    layer = max(g.nbytes for g in layout.groups)
    part = max(g.nbytes for g in PackLayout.from_plans(plan, max_group_bytes=PART).groups)
    return dict(
        replica=replica, received=layout.nbytes, file=os.path.getsize(path), plan_host=plan_host, layer=layer, part=part
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--ranks", default="0,-1", help="ranks per plan (negative: from the end)")
    args = ap.parse_args(argv)
    print(
        f"{'plan':<58} {'rank':>4} {'replica':>10} {'received':>10} | {'plan file':>9} {'plan host':>9} "
        f"{'one layer':>10} {'part<=256M':>10} {'shardplan':>10} {'ratio':>6}"
    )
    for path in args.plans:
        world = PlanFile.read(path).header.ranks
        for r in [world[int(x)] for x in args.ranks.split(",")]:
            f = rank_figures(path, r)
            total = f["plan_host"] + f["layer"]
            print(
                f"{os.path.basename(path):<58} {r:>4} {human_bytes(f['replica']):>10} "
                f"{human_bytes(f['received']):>10} | "
                f"{human_bytes(f['file']):>9} {human_bytes(f['plan_host']):>9} {human_bytes(f['layer']):>10} "
                f"{human_bytes(f['part']):>10} {human_bytes(total):>10} {f['replica'] / total:>5.0f}x"
            )
    print(
        "replica: every param of the target rank (SGLang P2P's engine replica); received: the bytes the rank loads "
        "(its ceiling);\nshardplan: plan host (file read + rank instantiated, tracemalloc peak) + one layer of the "
        "rank's bytes staged (with 256 MiB parts: 'part')"
    )


if __name__ == "__main__":
    main()
