"""Plan instantiation, end to end, for every shipped plan (issue 14, item 3):

    python bench/instantiate_bench.py [--plans plans/*.plan] [--ranks 4] [--repeat 3] [--baseline-src DIR]

Per plan: read the file (bytes), decode + validate it (whole file; and the columnar tree's id table of the checkpoint
names), then per sampled rank (first, last and random ones), cold (the file decoded afresh and module-level caches
emptied first, untimed: what a trainer process pays for its one rank): instantiate the rank (bounds checks included),
build the trainer side (`Replayer(plan, sources)`: its PackLayout, checks and batches) and the consumer side
(`Applier(plan, layout, params)`, params on the meta device, built before the clock starts). Medians over the sampled
ranks (decode: over --repeat runs). Bar: instantiate + Replayer + Applier <= 50 ms per rank.

The garbage collector runs (`gc.collect()`, untimed) before each timed part: in a process that imported torch a full
collection takes ~100-190 ms, and one falls due every ~100k surviving allocations, so without it a part's figure
said mostly whether the harness (the object-path baseline allocates ~1M objects per rank) had left one due there
(a qwen3-next decode read 15 ms or 88 ms from run to run). The collector stays on inside the parts: collections
that the part's own allocations make due still count.

Baseline, same invocation: `--baseline-src DIR` runs the same measurement in a child process whose `shardplan` is the
tree at DIR, e.g. the pre-columnar code: `git -C . worktree add /tmp/base <commit>` or `git archive <commit> shardplan
| tar -x -C DIR`. Without it the baseline is the object path of the test references (tests/reference.py): `rank_objects`
(instantiate) and `reference_layout` (the pack layout); the pre-columnar Replayer/Applier are not reachable
then (printed as "-").

`instantiation_table(paths, ...)` returns the rows (and `format_table(rows)` the text) for bench/compile_bench.py.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time

PARTS = ("read", "decode", "instantiate", "replayer", "applier")
# process CPU time by default: on a shared box wall time mostly measures the other processes (--clock wall for it)
CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCK[os.environ.get("SHARDPLAN_BENCH_CLOCK", "cpu")]


def measure(path: str, num_ranks: int, repeat: int, objects: bool = False) -> dict:
    """Times of each part for one plan file, in this process (medians, milliseconds). `objects`: the in-tree object
    path (rank_objects + reference_layout) instead of the columnar one."""
    if objects:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        import reference
    import torch

    from shardplan.plan.file.format import PlanFile, read_plan_bytes
    from shardplan.runtime.apply import Applier
    from shardplan.runtime.replay import Replayer

    reads, decodes = [], []
    for _ in range(repeat):
        gc.collect()
        t0 = clock()
        data = read_plan_bytes(path)
        t1 = clock()
        header, body = _decode(data, path)
        t2 = clock()
        reads.append(t1 - t0)
        decodes.append(t2 - t1)
    ranks = list(PlanFile(header, body, path).ranks)
    rng = random.Random(0)
    sample = sorted(set([ranks[0], ranks[-1]] + rng.sample(ranks, min(len(ranks), max(0, num_ranks - 2)))))
    times = {k: [] for k in ("instantiate", "replayer", "applier")}
    num_writes = 0
    for rank in sample:
        # cold, as a trainer process instantiating its one rank: a freshly decoded file (decode is timed above) and
        # no module-level caches, so nothing is reused from an earlier rank (names, groups)
        header, body = _decode(data, path)
        _clear_module_caches()
        plan_file = PlanFile(header, body, path)
        gc.collect()
        t0 = clock()
        plan = reference.rank_objects(plan_file, rank) if objects else plan_file.rank(rank)
        t1 = clock()
        num_writes = len(plan.writes)
        params = {p.name: torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta") for p in plan.params}
        gc.collect()
        if objects:
            t2 = clock()
            reference.reference_layout(plan)
            t3 = t4 = clock()
            times["applier"].append(float("nan"))
        else:
            t2 = clock()
            replayer = Replayer(plan, plan_file.sources)
            t3 = clock()
            gc.collect()
            t_applier = clock()
            Applier(plan, replayer.layout, params)
            t4 = clock()
            times["applier"].append(t4 - t_applier)
        times["instantiate"].append(t1 - t0)
        times["replayer"].append(t3 - t2)
    row = {
        "plan": os.path.basename(path),
        "ranks": sample,
        "writes": num_writes,
        "read": statistics.median(reads),
        "decode": statistics.median(decodes),
    }
    row.update({k: statistics.median(v) for k, v in times.items()})
    return {k: (v * 1e3 if isinstance(v, float) else v) for k, v in row.items()}


def _decode(data: bytes, path: str):
    from shardplan.plan.file.format import decode

    header, body = decode(data, path)
    try:  # the columnar tree numbers the source table's names once per file (cached on it): part of loading it
        from shardplan.plan.columns import table_ids

        table_ids(body.sources)
    except ImportError:
        pass
    return header, body


def _clear_module_caches() -> None:
    import importlib

    caches = {  # module -> its caches (packcols: runtime/segments.py's name in a --baseline-src tree)
        "shardplan.runtime.segments": ("_GROUPS", "_GROUP_ORDERS"),
        "shardplan.runtime.packcols": ("_GROUPS", "_GROUP_ORDERS"),
        "shardplan.plan.file.bounds": ("_MEMO",),
    }
    for module, names in caches.items():
        try:
            held = importlib.import_module(module)
        except ImportError:
            continue
        for name in names:
            getattr(held, name, {}).clear()


def _baseline(path: str, num_ranks: int, repeat: int, src: str | None) -> dict:
    if src is None:
        return measure(path, num_ranks, repeat, objects=True)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]); "
        "import instantiate_bench as b; print(json.dumps(b.measure(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))"
    )
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            os.path.abspath(src),
            os.path.dirname(os.path.abspath(__file__)),
            path,
            str(num_ranks),
            str(repeat),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def instantiation_table(
    paths: list[str] | None = None, num_ranks: int = 4, repeat: int = 3, baseline_src: str | None = None
) -> list[dict]:
    """Rows {plan, writes, ranks, new: {part: ms}, base: {part: ms}} for every plan (default: plans/*.plan)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = paths or sorted(glob.glob(os.path.join(root, "plans", "*.plan")))
    rows = []
    for path in paths:
        new = measure(path, num_ranks, repeat)
        base = _baseline(path, num_ranks, repeat, baseline_src)
        rows.append({"plan": new["plan"], "writes": new["writes"], "ranks": new["ranks"], "new": new, "base": base})
        print(format_table(rows[-1:], header=len(rows) == 1), flush=True)
    return rows


def _cell(new: float, base: float) -> str:
    if base != base:  # nan: not reachable
        return f"{new:7.1f} / {'-':>7}"
    return f"{new:7.1f} / {base:7.1f}"


def format_table(rows: list[dict], header: bool = True) -> str:
    lines = []
    if header:
        lines.append(
            f"{'plan':40} {'writes':>6}  "
            + "  ".join(f"{p + ' new/base ms':>19}" for p in PARTS)
            + f"  {'inst+rep+app':>19}"
        )
    for r in rows:
        new, base = r["new"], r["base"]
        total_new = new["instantiate"] + new["replayer"] + new["applier"]
        total_base = base["instantiate"] + base["replayer"] + base["applier"]
        lines.append(
            f"{r['plan'][:40]:40} {r['writes']:6d}  "
            + "  ".join(f"{_cell(new[p], base[p]):>19}" for p in PARTS)
            + f"  {_cell(total_new, total_base):>19}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", nargs="*", default=None)
    parser.add_argument("--ranks", type=int, default=4, help="ranks sampled per plan (first, last, random)")
    parser.add_argument("--repeat", type=int, default=3, help="decode repeats")
    parser.add_argument("--baseline-src", default=None, help="a tree whose shardplan is the baseline")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCK),
        default=os.environ.get("SHARDPLAN_BENCH_CLOCK", "cpu"),
        help="process CPU time (default) or wall time",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCK[args.clock]
    os.environ["SHARDPLAN_BENCH_CLOCK"] = args.clock  # the baseline child process uses the same clock
    print(
        f"# {args.clock} time, gc.collect() before each timed part; load average {os.getloadavg()[0]:.1f}, "
        f"{os.cpu_count()} CPUs; baseline: "
        f"{args.baseline_src or 'object path of tests/reference.py (rank_objects + reference_layout)'}",
        flush=True,
    )
    rows = instantiation_table(args.plans, args.ranks, args.repeat, args.baseline_src)
    worst = max(r["new"]["instantiate"] + r["new"]["replayer"] + r["new"]["applier"] for r in rows)
    print(f"# worst instantiate+Replayer+Applier: {worst:.1f} ms (bar 50 ms); load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
