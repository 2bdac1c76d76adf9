"""Issue-3 bars, measured in one invocation:

    python bench/compile_bench.py [--model kimi-k2] [--skip-exhaustive]

1. `shardplan record --model M --tp 32 --ep` for all ranks: wall time and peak RSS (a child process each), next to
   the same command with --exhaustive (every rank recorded fully: the brute-force baseline); outputs must be
   byte-identical.
2. Plan size on disk: TP32+EP and TP32 without EP.
3. Loading + instantiating one rank's plan in a fresh trainer process (no vLLM imported): median over ranks.
Bars: record <= 20 s and <= 1 GB RSS; TP32+EP plan <= 1 MB, TP32 <= 2 MB; load+instantiate <= 50 ms.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_record(model: str, flags: list[str], out: Path) -> tuple[float, float, Path]:
    cmd = [sys.executable, "-m", "shardplan.cli", "record", "--model", model, *flags, "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(proc.stderr)
    # ru_maxrss of children is the max over all children so far: run the smaller job first
    rss = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before) / 1024
    note = [l for l in proc.stdout.splitlines() if l.startswith("recording:")]
    print(f"  {' '.join(cmd[3:])}: {wall:.1f}s, {note[0] if note else ''}", flush=True)
    return wall, rss, next(out.glob("*.plan"))


def load_time(path: Path, ranks: list[int]) -> float:
    code = f"""
import sys, time, statistics
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('vllm', 'transformers', 'safetensors'):
            raise ImportError(name)
sys.meta_path.insert(0, Block())
import torch  # a trainer has torch loaded already; not part of the plan's cost
from shardplan.plan.planfile import PlanFile
times = []
for rank in {ranks!r}:
    t0 = time.perf_counter()
    plan = PlanFile.read({str(path)!r}).rank(rank)
    times.append(time.perf_counter() - t0)
print(statistics.median(times), len(plan.writes))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kimi-k2")
    ap.add_argument("--tp", type=int, default=32)
    ap.add_argument("--skip-exhaustive", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("recording (each in a child process):")
        wall, rss, sampled = run_record(args.model, ["--tp", str(args.tp), "--ep"], tmp / "ep")
        rows.append((f"record {args.model} tp{args.tp}-ep, all ranks", f"{wall:.1f} s", "<= 20 s"))
        rows.append(("  peak RSS", f"{rss:.0f} MiB", "<= 1 GB"))
        _, _, no_ep = run_record(args.model, ["--tp", str(args.tp)], tmp / "noep")
        if not args.skip_exhaustive:
            wall_x, rss_x, exhaustive = run_record(args.model, ["--tp", str(args.tp), "--ep", "--exhaustive"],
                                                   tmp / "ex")
            same = sampled.read_bytes() == exhaustive.read_bytes()
            rows.append((f"  baseline --exhaustive", f"{wall_x:.1f} s ({wall_x / wall:.1f}x)", "brute force"))
            rows.append(("  output byte-identical to --exhaustive", str(same), "True"))
        rows.append((f"plan size tp{args.tp}-ep", f"{sampled.stat().st_size / 1024:.0f} KiB", "<= 1 MB"))
        rows.append((f"plan size tp{args.tp}", f"{no_ep.stat().st_size / 1024:.0f} KiB", "<= 2 MB"))
        ranks = [0, args.tp // 2, args.tp - 1]
        rows.append((f"load + instantiate one rank, tp{args.tp}-ep", f"{load_time(sampled, ranks) * 1e3:.1f} ms",
                     "<= 50 ms"))
        rows.append((f"load + instantiate one rank, tp{args.tp}", f"{load_time(no_ep, ranks) * 1e3:.1f} ms",
                     "(no bar)"))
    print(f"\n{'measure':<48} {'value':>20} {'bar':>12}")
    for name, value, bar in rows:
        print(f"{name:<48} {value:>20} {bar:>12}")


if __name__ == "__main__":
    main()
