"""Where `shardplan record`'s time and peak memory go, stage by stage, one rank against the whole layout:

    python bench/record_stages.py [--model kimi-k2] [--layouts "--tp 32 --dp 8;--tp 32 --ep"] [--baseline-src DIR]
                                  [--repeat 1]

Each layout runs twice in a child process (`--ranks 0`, then every rank) with the record command's stages wrapped:
the session (config, checkpoint names), recording + rank extension (`extend_ranks`), templating the ranks
(`body_from_flat`), the layer extension, its check, the per-rank figures and the encoding. Printed per stage: process
CPU seconds and the peak RSS when it ends (ru_maxrss). What grows with the number of ranks shows as the difference of
the two rows; the child's own import and exit are not in it. `--baseline-src DIR` runs the same in a child whose
`shardplan` is DIR's (`git archive REV shardplan | tar -x -C DIR`), on the row above. On a shared box, compare
within one invocation: stage CPU seconds are short, so load swings them less than a whole command's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["session", "record + extend ranks", "body_from_flat", "extend_layers", "unwritten check", "figures", "encode"]

CHILD = r"""
import functools, json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from shardplan import cli
from shardplan.record import session as S
out = []

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def wrap(owner, name, stage):
    f = getattr(owner, name)
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.process_time()
        try:
            return f(*a, **k)
        finally:
            out.append((stage, time.process_time() - t0, peak()))
    setattr(owner, name, g)

for owner, name, stage in [(S.RecordSession, "__init__", "session"), (S, "extend_ranks", "record + extend ranks"),
                           (S, "body_from_flat", "body_from_flat"), (S, "extend_layers", "extend_layers"),
                           (S, "unwritten_after_extension", "unwritten check"), (S, "rank_figures", "figures"),
                           (S.RecordSession, "encode", "encode")]:
    wrap(owner, name, stage)
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    rc = cli.main(sys.argv[2:])
totals = {}
for stage, cpu, rss in out:   # the cut model's session is a second __init__: summed, peak the last
    seconds, _ = totals.get(stage, (0.0, 0.0))
    totals[stage] = (seconds + cpu, rss)
print(json.dumps({"rc": rc, "stages": totals, "peak": peak()}))
"""


def run(src: Path, model: str, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-c", CHILD, str(src), "record", "--model", model, *flags, "--out", tmp]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(src)}, cwd=str(src)
        )
    if proc.returncode:
        raise SystemExit(f"{shlex.join(cmd[3:])} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kimi-k2")
    ap.add_argument("--layouts", default="--tp 32 --dp 8;--tp 32 --ep;--tp 1 --dp 256 --ep")
    ap.add_argument("--baseline-src", default=None)
    ap.add_argument("--repeat", type=int, default=1, help="runs per row; the least CPU of each stage is kept")
    args = ap.parse_args()
    trees = ([("baseline", Path(args.baseline_src).resolve())] if args.baseline_src else []) + [("this tree", ROOT)]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    head = "".join(f"{s[:14]:>15}" for s in STAGES)
    print(
        f"\nCPU s per stage (peak RSS MiB when it ends)\n{'layout':<24} {'tree':<10} {'ranks':<6}{head}"
        f"{'sum':>8}{'peak MiB':>9}"
    )
    for layout in args.layouts.split(";"):
        flags = shlex.split(layout)
        for name, src in trees:
            for ranks, extra in (("one", ["--ranks", "0"]), ("all", [])):
                runs = [run(src, args.model, flags + extra) for _ in range(args.repeat)]
                cells, total = "", 0.0
                for stage in STAGES:
                    got = [r["stages"][stage] for r in runs if stage in r["stages"]]
                    if not got:
                        cells += f"{'-':>15}"
                        continue
                    cpu, rss = min(got)
                    total += cpu
                    cells += f"{cpu:>7.2f} ({rss:>4.0f})"
                print(
                    f"{layout:<24} {name:<10} {ranks:<6}{cells}{total:>8.2f}{min(r['peak'] for r in runs):>9.0f}",
                    flush=True,
                )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
