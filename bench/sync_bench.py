"""Sharded sync (the `nccl` transport) against raw NCCL send/recv and against broadcast-full-tensors-then-narrow.

    python bench/sync_bench.py                         # CUDA: trainer on GPU0, --num-consumers consumers on GPU1..N
    python bench/sync_bench.py --device cpu --cases small --iters 2   # CPU smoke test over gloo

One trainer process holds the FULL tensors of several decoder layers (each layer one contiguous storage, as a
trainer's flat parameter buffers are); each consumer process holds one TP rank's params. Per case, in one run:

  raw p2p        one NCCL send of all of a consumer's bytes (already packed) over the same pair: the ceiling
  sharded        the sync engine with pack/apply switched off: per-layer pipelined sends
  end to end     the sync engine with replay (ReplayPacker) and apply (ApplyUnpacker): replay + send + apply
                 (both after the version's announcement was read and connections opened: engine.prepare(), which a
                 trainer runs while the optimizer steps; not timed)
  broadcast      broadcast every full layer (double-buffered buckets) and narrow each write out of it (per-write
                 copy_, what a loader does): the checkpoint-engine style baseline
Timing: all ranks meet on the control channel, the trainer stamps t0, each consumer stamps its end after
torch.cuda.synchronize(); time = max(end) - t0 (wall clock, one host); median of --iters after one warm-up.
Correctness: params after end-to-end sync == params after broadcast+narrow, bitwise (per-param checksums), and one
verified sync (checksums on) completes.

Plans are synthesized (bench/replay_bench.py's builders: Kimi-K2 TP32 rank with/without EP, Llama-3.1-70B TP8 rank);
consumer j gets TP rank j. `--plan FILE` is a placeholder until plan files expand to RankPlans.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the shared GPU hosts require multicast off
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from shardplan.plan import ir  # noqa: E402  # noqa: E402
from shardplan.plan.interp import apply_reference, to_dtype  # noqa: E402
from shardplan.plan.names import group_of  # noqa: E402
from shardplan.runtime.apply import params_from_plan  # noqa: E402
from shardplan.sync import (
    PART_BYTES,
    ApplyUnpacker,
    ConsumerSync,
    Coordinator,
    ReplayPacker,  # noqa: E402
    SyncConfig,
    TrainerSync,
    set_event_listener,
    spans_of,
)
from shardplan.transport import Control, consumer_name, create  # noqa: E402

# SHARDPLAN_TRACE=1: record the engine's timeline, (wall time, thread, event) per step, and log the last run's
TRACE: list[tuple[float, str, str]] | None = [] if os.environ.get("SHARDPLAN_TRACE") else None
if TRACE is not None:
    set_event_listener(lambda event: TRACE.append((time.time(), threading.current_thread().name, event)))


# ---- plans -----------------------------------------------------------------------------------------------------------
def small_layer(layer: int, tp: int, rank: int):
    """A Llama-shaped layer small enough for a CPU smoke run (hidden 1024, 8 heads / 8 KV heads, inter 2816)."""
    from replay_bench import PlanBuilder

    hidden, inter = 1024, 2816
    b, pre = PlanBuilder(rank), f"model.layers.{layer}."
    rows, i_rows = hidden // tp, inter // tp
    qkv = b.param(pre + "self_attn.qkv_proj.weight", (3 * rows, hidden))
    for k, name in enumerate("qkv"):
        b.shard_rows(
            qkv, k * rows, b.source(pre + f"self_attn.{name}_proj.weight", (hidden, hidden)), rank * rows, rows
        )
    o = b.param(pre + "self_attn.o_proj.weight", (hidden, rows))
    b.shard_cols(o, b.source(pre + "self_attn.o_proj.weight", (hidden, hidden)), rank * rows, rows)
    gate_up = b.param(pre + "mlp.gate_up_proj.weight", (2 * i_rows, hidden))
    for k, name in enumerate(["gate", "up"]):
        b.shard_rows(
            gate_up, k * i_rows, b.source(pre + f"mlp.{name}_proj.weight", (inter, hidden)), rank * i_rows, i_rows
        )
    down = b.param(pre + "mlp.down_proj.weight", (hidden, i_rows))
    b.shard_cols(down, b.source(pre + "mlp.down_proj.weight", (hidden, inter)), rank * i_rows, i_rows)
    b.replicate(b.param(pre + "input_layernorm.weight", (hidden,)), b.source(pre + "input_layernorm.weight", (hidden,)))
    return b


def case_builder(case: str):
    from replay_bench import kimi_k2_layer, llama70b_layer

    if case.startswith("plan="):  # a recorded plan file: layers 1.. of consumer ranks 0..N-1
        from plan_cases import PlanLayer

        path = case.split("=", 1)[1]
        return (lambda layer, rank: PlanLayer(path, rank, layer + 1), 3)
    return {
        "llama": (lambda layer, rank: llama70b_layer(layer, tp=8, rank=rank), 8),
        "kimi-ep": (lambda layer, rank: kimi_k2_layer(layer + 1, tp=32, rank=rank, ep=True), 3),
        "kimi": (lambda layer, rank: kimi_k2_layer(layer + 1, tp=32, rank=rank, ep=False), 3),
        "small": (lambda layer, rank: small_layer(layer, tp=8, rank=rank), 4),
    }[case]


def build_plans(case: str, num_layers: int, num_consumers: int):
    """One RankPlan per consumer (TP rank j), several decoder layers; the sources table they read."""
    build, _ = case_builder(case)
    plans, sources = [], {}
    for rank in range(num_consumers):
        params, writes = {}, []
        for layer in range(num_layers):
            b = build(layer, rank)
            params.update(b.params)
            writes += b.writes
            sources.update(b.sources)
        plans.append(ir.RankPlan(rank, tuple(params.values()), tuple(writes)))
    return plans, sources


def flat_groups(sources, device):
    """Each weight group's tensors as views of one contiguous storage (a trainer's flat buffers)."""
    groups: dict[str, list] = {}
    for name in sorted(sources):
        groups.setdefault(group_of(name), []).append(name)
    flats, tensors = {}, {}
    for group, names in groups.items():
        offsets, offset = {}, 0
        for name in names:
            meta = sources[name]
            offsets[name] = offset
            offset = (offset + meta.numel * to_dtype(meta.dtype).itemsize + 255) // 256 * 256
        flat = torch.empty(offset, dtype=torch.uint8, device=device)
        for name in names:
            meta = sources[name]
            n = meta.numel * to_dtype(meta.dtype).itemsize
            tensors[name] = flat[offsets[name] : offsets[name] + n].view(to_dtype(meta.dtype)).view(meta.shape)
        flats[group] = flat
    return flats, tensors


class FlatSource:
    def __init__(self, tensors):
        self.tensors = tensors
        self.groups: dict[str, dict] = {}
        for name, t in tensors.items():
            self.groups.setdefault(group_of(name), {})[name] = t

    def metadata(self):
        return {n: ir.TensorMeta(n, tuple(t.shape), str(t.dtype)[6:]) for n, t in self.tensors.items()}

    def boxes(self):
        return {n: tuple((0, s) for s in t.shape) for n, t in self.tensors.items()}

    def group(self, group):
        return self.groups.get(group, {})


class Switch:
    """Packer / Unpacker wrapper whose work can be switched off: the engine then moves the same bytes, untouched."""

    def __init__(self, inner):
        self.inner, self.on = inner, True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def pack(self, *args):
        if self.on:
            self.inner.pack(*args)

    def apply(self, *args):
        if self.on:
            self.inner.apply(*args)


def param_sums(params) -> dict[str, int]:
    return {
        n: int(t.view(-1).view(torch.uint8).view(torch.int32).sum(dtype=torch.int64))
        if t.numel() * t.element_size() % 4 == 0
        else int(t.view(-1).view(torch.uint8).sum(dtype=torch.int64))
        for n, t in sorted(params.items())
    }


# ---- one process per GPU ---------------------------------------------------------------------------------------------
T_START = time.time()


def log(me: str, text: str) -> None:
    print(f"[{me} +{time.time() - T_START:6.1f}s] {text}", flush=True)


def worker(index: int, args, controls: dict, out_queue) -> None:
    import gc

    device = torch.device(f"cuda:{index}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for case in args.cases.split(","):
        run_case(index, case, device, args, Control(*controls[case]), out_queue)
        gc.collect()  # a Kimi case holds ~100 GB on the trainer GPU: free it before the next case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out_queue.put(("exit", index))


def run_case(index: int, case: str, device: torch.device, args, control: Control, out_queue) -> None:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    n = args.num_consumers
    me = "trainer0" if index == 0 else consumer_name(index - 1)
    _, default_layers = case_builder(case)
    layers = args.layers or default_layers
    plans, sources = build_plans(case, layers, n)
    if case == "kimi-ep":  # the trainer holds (and the broadcast baseline moves) every expert, not just the read ones
        sources = {**build_plans("kimi", layers, 1)[1], **sources}
    config = SyncConfig(timeout_s=120, verify=False, announce_timeout_s=600)
    part_bytes = args.part_mib << 20 if args.part_mib else None
    transport = create("nccl", me=me, control=control, device=device, timeout_s=120)
    if index == 0:
        flats, tensors = flat_groups(sources, device)
        for t in tensors.values():
            t.normal_()
        packer = Switch(ReplayPacker(plans, sources, device=device, max_group_bytes=part_bytes))
        engine = TrainerSync(0, packer, FlatSource(tensors), transport, control, config, device=device)
        coordinator = Coordinator(control, spans_of(packer), packer.groups(), 1, config)
    else:
        plan = plans[index - 1]
        params = params_from_plan(plan, device)
        unpacker = Switch(ApplyUnpacker(plan, params, max_group_bytes=part_bytes))
        engine = ConsumerSync(index - 1, unpacker, transport, control, config, device=device)
        group_sizes = dict(unpacker.sizes())
    # the broadcast baseline's group: every process of this case
    store = dist.PrefixStore(f"bcast/{case}/", control.lease())
    if device.type == "cuda":
        world = dist.ProcessGroupNCCL(store, index, n + 1, dist.ProcessGroupNCCL.Options())
    else:
        from datetime import timedelta

        world = dist.ProcessGroupGloo(store, index, n + 1, timedelta(seconds=300))
    groups = sorted({group_of(s) for s in sources}, key=lambda g: (len(g), g))
    bytes_per_consumer = None
    log(me, f"{case}: set up ({len(groups)} groups)")
    version = 0

    def timed(label: str, run, prepare=None) -> float:
        """One measurement: meet, trainer stamps t0, everyone runs, consumers stamp their end."""
        times = []
        for it in range(args.iters + 1):
            key = f"{case}/{label}/{it}"
            if prepare is not None:
                prepare()
            if TRACE is not None:
                TRACE.clear()
            if index == 0:
                for j in range(n):
                    control.get(f"{key}/ready/{j}", 600, consumer_name(j))
                sync()
                t0 = time.time()
                control.set(f"{key}/go", repr(t0))
                run()
                sync()
                t_end = time.time()
                ends = [float(control.get(f"{key}/end/{j}", 600, consumer_name(j))) for j in range(n)]
                if it:  # the first is the warm-up
                    times.append(max(ends) - t0)
            else:
                sync()
                control.set(f"{key}/ready/{index - 1}", "1")
                t0 = float(control.get(f"{key}/go", 600, "trainer0"))
                run()
                sync()
                t_end = time.time()
                control.set(f"{key}/end/{index - 1}", repr(t_end))
            if TRACE is not None and it == args.iters:  # the engine's timeline of the last run
                events = ", ".join(f"{what} {1e3 * (t - t0):.2f}" for t, _, what in TRACE)
                log(me, f"{case}: {label} trace (ms after go): {events}, end {1e3 * (t_end - t0):.2f}")
        return statistics.median(times) if times else 0.0

    # -- engine syncs: transfer only, then end to end --
    def engine_prepare():
        # the driver announces a version when the optimizer step starts, and every rank prepares it (reads the
        # announcement, opens connections) meanwhile: control-plane work ahead of the sync, not timed
        nonlocal version
        version += 1
        if index == 0:
            coordinator.announce(version)
        engine.prepare(version)

    def engine_run():
        engine.sync(version)

    def switch(on: bool):
        (packer if index == 0 else unpacker).on = on

    switch(True)
    engine_prepare()
    engine_run()  # packs real bytes into both staging slots once, so transfer-only runs move real data
    log(me, f"{case}: first sync done (pairs open, NCCL communicators up)")
    switch(False)
    t_sharded = timed("sharded", engine_run, engine_prepare)
    if index == 0:
        log(me, f"{case}: sharded (transfer only) {t_sharded * 1e3:.2f} ms")
    switch(True)
    t_e2e = timed("e2e", engine_run, engine_prepare)
    if index == 0:
        log(me, f"{case}: end to end {t_e2e * 1e3:.2f} ms")
    # one verified sync (checksums on both sides): must complete
    engine.config.verify = True
    engine_prepare()
    engine_run()
    engine.config.verify = False
    if index > 0:
        e2e_sums = param_sums(params)
        bytes_per_consumer = sum(group_sizes.values())
        control.set(f"{case}/bytes/{index - 1}", str(bytes_per_consumer))

    # -- raw p2p: the same bytes, one send per consumer, over the same pair --
    if index == 0:
        totals = [int(control.get(f"{case}/bytes/{j}", 600, consumer_name(j))) for j in range(n)]
        raw = [torch.zeros(t, dtype=torch.uint8, device=device) for t in totals]

        def raw_run():
            works = [transport.pairs[consumer_name(j)].pg.send([raw[j]], 1, 0) for j in range(n)]
            for w in works:
                w.wait()

        t_raw = timed("raw", raw_run)
    else:
        raw_buf = torch.zeros(bytes_per_consumer, dtype=torch.uint8, device=device)

        # Post the receive only after "go": a pre-posted NCCL recv occupies the stream, and timed()'s synchronize
        # before "ready" would then wait for a send that only starts after "ready" (the first H200 run hung here).
        t_raw = timed("raw", lambda: transport.pairs["trainer0"].pg.recv([raw_buf], 0, 0).wait())

    # -- broadcast full layers, narrow on the consumer --
    if index == 0:

        def bcast_run():
            works = [world.broadcast([flats[g]], _root0()) for g in groups]
            for w in works:
                w.wait()

        t_bcast = timed("broadcast", bcast_run)
    else:
        _, layout = flat_groups_meta(sources)
        biggest = max(layout[g][1] for g in groups)
        buckets = [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(2)]
        views = [
            {
                name: buckets[k][off : off + nb].view(to_dtype(sources[name].dtype)).view(sources[name].shape)
                for g in groups
                for name, (off, nb) in layout[g][0].items()
            }
            for k in range(2)
        ]
        writes_by_group = {
            g: ir.RankPlan(plan.rank, plan.params, tuple(w for w in plan.writes if group_of(w.param) == g))
            for g in groups
        }

        def bcast_run():
            pending = world.broadcast([buckets[0][: layout[groups[0]][1]]], _root0())
            for k, g in enumerate(groups):
                pending.wait()
                if k + 1 < len(groups):  # the next layer arrives while this one is narrowed
                    nxt = groups[k + 1]
                    pending = world.broadcast([buckets[(k + 1) % 2][: layout[nxt][1]]], _root0())
                apply_reference(writes_by_group[g], views[k % 2], params)

        for t in params.values():
            t.zero_()
        t_bcast = timed("broadcast", bcast_run)
        bcast_sums = param_sums(params)
        mismatched = [name for name in e2e_sums if e2e_sums[name] != bcast_sums[name]]
        out_queue.put(("check", case, index - 1, mismatched, bytes_per_consumer))
        log(
            me,
            f"{case}: params after end-to-end sync == after broadcast+narrow: "
            f"{'bitwise' if not mismatched else f'DIFFER in {mismatched[:5]}'}",
        )
    if index == 0:
        full = sum(f.numel() for f in flats.values())
        out_queue.put(
            (
                "times",
                case,
                {
                    "raw": t_raw,
                    "sharded": t_sharded,
                    "e2e": t_e2e,
                    "broadcast": t_bcast,
                    "full_bytes": full,
                    "num_writes": [len(p.writes) for p in plans],
                },
            )
        )
        useful = sum(totals)
        log(
            me,
            f"{case}: useful {useful} B; ms raw {t_raw * 1e3:.2f} sharded {t_sharded * 1e3:.2f} "
            f"e2e {t_e2e * 1e3:.2f} broadcast {t_bcast * 1e3:.2f}; GB/s raw {useful / t_raw / 1e9:.1f} sharded "
            f"{useful / t_sharded / 1e9:.1f} e2e {useful / t_e2e / 1e9:.1f}; sharded/raw {t_raw / t_sharded:.3f} "
            f"e2e/raw {t_e2e / t_raw:.3f} bcast/e2e {t_bcast / t_e2e:.2f}x",
        )
    transport.close()
    try:
        world.abort()
    except Exception:  # noqa: BLE001 - best effort: the case is over
        pass
    log(me, f"{case}: done")


def _root0():
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def flat_groups_meta(sources):
    """(name -> (offset, nbytes), group nbytes) per group, as flat_groups lays them out."""
    groups: dict[str, list] = {}
    for name in sorted(sources):
        groups.setdefault(group_of(name), []).append(name)
    out = {}
    for group, names in groups.items():
        offsets, offset = {}, 0
        for name in names:
            meta = sources[name]
            nb = meta.numel * to_dtype(meta.dtype).itemsize
            offsets[name] = (offset, nb)
            offset = (offset + nb + 255) // 256 * 256
        out[group] = (offsets, offset)
    return None, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default="llama,kimi-ep,kimi", help="comma list of llama, kimi-ep, kimi, small")
    ap.add_argument("--num-consumers", type=int, default=1, help="consumer processes (GPU1..N); TP ranks 0..N-1")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: llama 8, kimi 3, small 4)")
    ap.add_argument("--iters", type=int, default=5, help="timed runs per measurement (median), after one warm-up")
    ap.add_argument("--plan", default=None, help="also sync layers of these recorded plan files (comma list)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument(
        "--part-mib",
        type=int,
        default=PART_BYTES >> 20,
        help="pipeline unit: decoder layers larger than this move in parts (0: whole layers)",
    )
    args = ap.parse_args()
    if args.plan:
        args.cases = ",".join([c for c in args.cases.split(",") if c] + [f"plan={p}" for p in args.plan.split(",")])
    if args.device == "cuda" and torch.cuda.device_count() < args.num_consumers + 1:
        raise SystemExit(f"need {args.num_consumers + 1} GPUs, found {torch.cuda.device_count()}")
    print(
        f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version() if args.device == 'cuda' else '-'}, "
        f"device {args.device}, consumers {args.num_consumers}, iters {args.iters}, parts of {args.part_mib} MiB",
        flush=True,
    )
    servers = {case: Control.serve("127.0.0.1") for case in args.cases.split(",")}
    controls = {case: (c.host, c.port) for case, c in servers.items()}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(i, args, controls, queue)) for i in range(args.num_consumers + 1)]
    for p in procs:
        p.start()
    rows, checks, exited = [], {}, 0
    while exited < len(procs):
        msg = queue.get(timeout=1800)
        if msg[0] == "exit":
            exited += 1
        elif msg[0] == "check":
            _, case, j, mismatched, nbytes = msg
            checks.setdefault(case, []).append((j, mismatched, nbytes))
        else:
            _, case, t = msg
            rows.append((case, t))
            print(f"# {case} done", flush=True)
    for p in procs:
        p.join()
    header = f"{'case':8} {'what':10} {'bytes':>12} {'time ms':>9} {'GB/s':>8} {'vs raw p2p':>10} {'vs bcast':>9}"
    print(header)
    out = []
    for case, t in rows:
        nbytes = sum(c[2] for c in checks[case])
        bad = {j: m for j, m, _ in checks[case] if m}
        for what in ("raw", "sharded", "e2e", "broadcast"):
            moved = t["full_bytes"] * args.num_consumers if what == "broadcast" else nbytes
            gbps = nbytes / t[what] / 1e9 if t[what] else 0.0  # useful bytes per second (what consumers need)
            ratio = t["raw"] / t[what] if t[what] else 0.0
            speedup = t["broadcast"] / t[what] if t[what] else 0.0
            print(f"{case:8} {what:10} {moved:12d} {t[what] * 1e3:9.2f} {gbps:8.1f} {ratio:10.3f} {speedup:8.2f}x")
            out.append(
                {
                    "case": case,
                    "what": what,
                    "bytes_moved": moved,
                    "useful_bytes": nbytes,
                    "seconds": t[what],
                    "useful_GBps": gbps,
                    "raw_over_this": ratio,
                    "bcast_over_this": speedup,
                }
            )
        print(
            f"{case:8} bars: sharded >= 85% of raw p2p: {t['raw'] / t['sharded']:.3f} "
            f"({'ok' if t['raw'] / t['sharded'] >= 0.85 else 'MISSED'}); end to end <= 1.15x raw: "
            f"{t['e2e'] / t['raw']:.3f} ({'ok' if t['e2e'] / t['raw'] <= 1.15 else 'MISSED'}); "
            f"params e2e == broadcast+narrow: {'bitwise' if not bad else f'DIFFER {bad}'}; "
            f"writes per consumer {t['num_writes']}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
