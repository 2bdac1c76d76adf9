"""Per-rank record time for a model at real dimensions (meta device), next to the bare real loader in the same run.

    python bench/record_bench.py --model kimi-k2 --tp 32 [--rank 0] [--repeat 3]

For each of (no EP, EP): builds the rank's model on meta, then times
  bare:    model.load_weights() fed plain meta tensors (what vLLM's own loader costs with no data)
  record:  shardplan's recording of the same loader (RecTensor + recorder mode), on a fresh build
and prints the ratio. The recorder pauses CPython's cycle collector while it records (see record_loader); the bare
loader is timed both as vLLM runs it (collector on) and with the collector paused too, and the ratio is taken against
the faster of the two, so the pause is not counted as a recording speed-up. Bar (issue 2): record <= 1.3x bare. Times
are this process's CPU time (time.process_time), so other work on the machine does not skew the ratio; both runs are
single-threaded Python.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch


def bare_load(model, tensors, *, collect: bool) -> float:
    def feed():
        for name, shape, dtype in tensors:
            yield name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta")

    if not collect:
        gc.disable()
    try:
        t0 = time.process_time()
        model.load_weights(feed())
        return time.process_time() - t0
    finally:
        gc.enable()


def main() -> None:
    from shardplan.plan.layout import Layout
    from shardplan.record.build import build_for_recording
    from shardplan.record.loader import record_loader
    from shardplan.record.session import RecordSession

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kimi-k2")
    ap.add_argument("--tp", type=int, default=32)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ep", choices=["both", "on", "off"], default="both")
    args = ap.parse_args()
    rows = []
    for ep in {"both": (False, True), "on": (True,), "off": (False,)}[args.ep]:
        session = RecordSession(args.model, Layout(tp=args.tp, ep=ep))
        bare, bare_on, recs = [], [], []
        for _ in range(args.repeat):
            model, _ = build_for_recording(session.vllm_config, session.layout, args.rank)
            bare_on.append(bare_load(model, session.tensors, collect=True))
            del model
            gc.collect()
            model, _ = build_for_recording(session.vllm_config, session.layout, args.rank)
            bare.append(bare_load(model, session.tensors, collect=False))
            del model
            gc.collect()
            model, _ = build_for_recording(session.vllm_config, session.layout, args.rank)
            t0 = time.process_time()
            recording = record_loader(model, session.tensors, rank=args.rank)
            recs.append(time.process_time() - t0)
            num_writes = len(recording.writes)
            del model, recording
            gc.collect()
        print(
            "  raw",
            [round(x, 2) for x in bare_on],
            [round(x, 2) for x in bare],
            [round(x, 2) for x in recs],
            flush=True,
        )
        b_on, b, r = statistics.median(bare_on), statistics.median(bare), statistics.median(recs)
        rows.append(
            (
                f"{args.model} tp{args.tp}{' ep' if ep else ''} rank {args.rank}",
                len(session.tensors),
                num_writes,
                b_on,
                b,
                r,
                r / min(b, b_on),
            )
        )
    print(
        f"{'case':<28} {'tensors':>8} {'writes':>7} {'bare s (gc on)':>15} {'bare s (gc off)':>16} "
        f"{'record s':>9} {'ratio':>6}"
    )
    for case, n, w, b_on, b, r, ratio in rows:
        print(f"{case:<28} {n:>8} {w:>7} {b_on:>15.2f} {b:>16.2f} {r:>9.2f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
