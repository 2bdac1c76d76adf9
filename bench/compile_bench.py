"""Issue-14 bars (and the issue-3 plan figures), measured in one invocation:

    python bench/compile_bench.py [--model kimi-k2] [--curve 8,16,32,64,128,256] [--families tp-ep,tp,dp-ep]
                                  [--exhaustive-ranks 2] [--skip-exhaustive] [--seed 0] [--repeat 1]
                                  [--baseline-src DIR]

1. The fixed part: `import vllm` alone in a fresh interpreter (vLLM's share), next to the one-rank command.
2. The curve: for each layout family and rank count N, `shardplan record` of the whole layout (a child process,
   imports included) next to the same command with `--ranks 0`, run right before it: wall time, the ratio (bar:
   <= 1.3x, flat in N), peak RSS of each (os.wait4, per child), and their CPU time (which a loaded box disturbs
   less than the wall time). Families: tp-ep = `--tp N --ep` up to TP 64, then
   `--tp 32 --dp N/32 --ep`; tp = the same without --ep; dp-ep = `--tp 1 --dp N --ep`. With `--baseline-src DIR`
   each point is also run (alternated with this tree's) by a child whose `shardplan` is DIR's (e.g. the tree before
   a change: `git archive REV shardplan | tar -x -C DIR`), printed on the row above as "baseline".
3. The proof, same invocation: the whole-layout plans of Kimi-K2 TP32+EP and TP32 are cmp'd against plans/ (recorded
   exhaustively when shipped); for TP32+EP, TP32 and DP128+EP, `--exhaustive` (every rank and layer recorded) runs on
   a random subset of ranks, because a full exhaustive run takes minutes per layout, and each of those ranks'
   instantiated plans must equal the extended plan's.
4. Plan size on disk and load + instantiate one rank: `instantiation_rows` (bench/instantiate_bench.py has the
   per-part table, Replayer and Applier included).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_record(
    model: str, flags: list[str], out: Path, src: str | None = None
) -> tuple[float, float, str, Path, float]:
    """(wall s, peak RSS MiB, the `recording:` line, the plan, CPU s of the child: less disturbed by a loaded box)."""
    cmd = [sys.executable, "-m", "shardplan.cli", "record", "--model", model, *flags, "--out", str(out)]
    # `python -m` puts the working directory first on sys.path: the baseline's child runs in its tree
    env = None if src is None else {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    cwd = None if src is None else str(Path(src).resolve())
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=cwd)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak RSS, not the max over all children
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{stdout[-3000:]}")
    how = next((line[len("recording: ") :] for line in stdout.splitlines() if line.startswith("recording:")), "")
    return wall, usage.ru_maxrss / 1024, how, next(out.glob("*.plan")), usage.ru_utime + usage.ru_stime


def import_vllm_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import vllm"], check=True, capture_output=True)
    return time.perf_counter() - t0


def family_flags(family: str, n: int) -> list[str] | None:
    if family == "dp-ep":
        return ["--tp", "1", "--dp", str(n), "--ep"]
    ep = ["--ep"] if family == "tp-ep" else []
    if n <= 64:
        return ["--tp", str(n), *ep]
    if n % 32:
        return None
    return ["--tp", "32", "--dp", str(n // 32), *ep]


def same_ranks(extended: Path, exhaustive: Path, ranks: list[int]) -> bool:
    """Every listed rank's instantiated plan is equal in both files."""
    code = f"""
from shardplan.plan.file.format import PlanFile
a, b = PlanFile.read({str(extended)!r}), PlanFile.read({str(exhaustive)!r})
print(all(a.rank(r) == b.rank(r) and a.not_needed(r) == b.not_needed(r) for r in {ranks!r}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip() == "True"


# ---- LEAD: plan instantiation table (issue 14 item 3, the columnar helper) goes here -----------------------
def instantiation_rows(plans: dict[str, Path]) -> list[tuple[str, str, str]]:
    """(measure, value, bar) rows for the plans recorded above (name -> path): size on disk; load + instantiate one
    rank in a fresh trainer process without vLLM (median over three ranks), in process CPU time like
    bench/instantiate_bench.py (its read + decode + instantiate columns) and in wall time."""
    rows = []
    for name, path in plans.items():
        rows.append((f"plan size {name}", f"{path.stat().st_size / 1024:.0f} KiB", "<= 2 MB"))
        cpu, wall = load_time(path)
        rows.append(
            (f"load + instantiate one rank, {name} (CPU / wall)", f"{cpu * 1e3:.1f} / {wall * 1e3:.1f} ms", "<= 50 ms")
        )
    return rows


def load_time(path: Path) -> tuple[float, float]:
    code = f"""
import sys, time, statistics
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('vllm', 'transformers', 'safetensors'):
            raise ImportError(name)
sys.meta_path.insert(0, Block())
import torch  # a trainer has torch loaded already; not part of the plan's cost
from shardplan.plan.file.format import PlanFile
ranks = PlanFile.read({str(path)!r}).ranks
cpu, wall = [], []
for rank in (ranks[0], ranks[len(ranks) // 2], ranks[-1]):
    t0, w0 = time.process_time(), time.perf_counter()
    plan = PlanFile.read({str(path)!r}).rank(rank)
    cpu.append(time.process_time() - t0)
    wall.append(time.perf_counter() - w0)
print(statistics.median(cpu), statistics.median(wall))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


# ---- end of the LEAD section -------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kimi-k2")
    ap.add_argument("--curve", default="8,16,32,64,128,256")
    ap.add_argument("--families", default="tp-ep,tp,dp-ep")
    ap.add_argument("--exhaustive-ranks", type=int, default=2, help="ranks per layout recorded with --exhaustive")
    ap.add_argument("--skip-exhaustive", action="store_true")
    ap.add_argument(
        "--prove-all",
        action="store_true",
        help="prove every measured point against --exhaustive (default: the headline layouts only)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="alternated runs per point; the fastest of each is kept")
    ap.add_argument("--baseline-src", default=None, help="a tree whose shardplan runs each point too (baseline row)")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    rows = [("import vllm alone (vLLM's fixed share), fresh interpreter", f"{import_vllm_seconds():.1f} s", "")]
    headline = {("tp-ep", 32): "tp32-ep", ("tp", 32): "tp32", ("dp-ep", 128): "dp128-ep"}
    counts = sorted({int(n) for n in args.curve.split(",")} | ({32, 128} if args.model == "kimi-k2" else set()))
    kept: dict[str, tuple[list[str], Path]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(
            f"\n{'layout':<28} {'N':>4} {'one rank s':>10} {'all ranks s':>11} {'ratio':>6} {'RSS 1 / all MiB':>16}"
            f" {'CPU 1 / all s':>14} {'ratio':>6}  how",
            flush=True,
        )
        for family in args.families.split(","):
            for n in counts:
                flags = family_flags(family, n)
                if flags is None or (n not in map(int, args.curve.split(",")) and (family, n) not in headline):
                    continue
                tag = f"{family}-{n}"
                trees = [None] + ([args.baseline_src] if args.baseline_src else [])
                runs: dict = {src: ([], []) for src in trees}
                for i in range(args.repeat):  # alternated, the fastest of each: the box's load swings within minutes
                    for src in trees:
                        where = "" if src is None else "base-"
                        runs[src][0].append(
                            run_record(args.model, [*flags, "--ranks", "0"], tmp / f"{where}{tag}-one-{i}", src)
                        )
                        runs[src][1].append(run_record(args.model, flags, tmp / f"{where}{tag}-{i}", src))
                for src in reversed(trees):  # the baseline's row first, this tree's under it
                    one, rss_one, _, _, cpu_one = min(runs[src][0])
                    every, rss_all, how, plan, cpu_all = min(runs[src][1])
                    recorded = how.split("; ")[-1].split(",  ")[0] if how else ""
                    label = " ".join(flags) if src is None else f"{' '.join(flags)} baseline"
                    print(
                        f"{label:<28} {n:>4} {one:>10.1f} {every:>11.1f} {every / one:>5.2f}x "
                        f"{rss_one:>7.0f} / {rss_all:<7.0f} {cpu_one:>6.1f} / {cpu_all:<5.1f} "
                        f"{cpu_all / cpu_one:>5.2f}x "
                        f"{recorded[:90]}",
                        flush=True,
                    )
                if args.baseline_src:
                    base_plan = min(runs[args.baseline_src][1])[3]
                    rows.append(
                        (
                            f"record {' '.join(flags)} (N={n}): same bytes as the baseline tree's",
                            str(base_plan.read_bytes() == plan.read_bytes()),
                            "True",
                        )
                    )
                rows.append((f"record {' '.join(flags)} (N={n}) / --ranks 0", f"{every / one:.2f}x", "<= 1.3x"))
                if (family, n) in headline:
                    kept[headline[(family, n)]] = (flags, plan)
                elif args.prove_all:
                    kept[tag] = (flags, plan)
        print(f"load average: {os.getloadavg()}", flush=True)
        for name, (flags, plan) in kept.items():
            shipped = ROOT / "plans" / f"{args.model}--{name}--bfloat16.plan"
            if shipped.exists():
                rows.append(
                    (
                        f"{name}: byte-identical to plans/{shipped.name}",
                        str(plan.read_bytes() == shipped.read_bytes()),
                        "True",
                    )
                )
            if args.skip_exhaustive:
                continue
            world = int(
                subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        f"from shardplan.plan.file.format import PlanFile; "
                        f"print(len(PlanFile.read({str(plan)!r}).ranks))",
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            subset = sorted(random.Random(args.seed).sample(range(world), min(args.exhaustive_ranks, world)))
            wall, _, _, exhaustive, _ = run_record(
                args.model, [*flags, "--exhaustive", "--ranks", ",".join(map(str, subset))], tmp / f"{name}-ex"
            )
            rows.append(
                (
                    f"{name}: ranks {subset} equal to --exhaustive (random subset; a full exhaustive run takes "
                    f"~{wall / len(subset) * world / 60:.0f} min)",
                    str(same_ranks(plan, exhaustive, subset)),
                    "True",
                )
            )
        rows += instantiation_rows({name: plan for name, (_, plan) in kept.items() if name in headline.values()})
    print(f"\n{'measure':<100} {'value':>10} {'bar':>9}")
    for name, value, bar in rows:
        print(f"{name:<100} {value:>10} {bar:>9}")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
