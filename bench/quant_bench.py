"""The quantizing pack a trainer runs, on the GPU: `QuantizingReplayer.pack` of one decoder layer of a shipped block-FP8
plan (one consumer rank), next to a same-run device copy of the same bytes.

Bytes, as for the copy, read + written: every block the quantizer must read (the rank's boxes of the trainer's bf16
weights, widened to whole blocks) + the fp8 bytes and float32 scales written + the other segments (bf16 norms, router:
read and written). The copy moves N bytes in and N out with 2N = those bytes. Variants: "fused" (the runtime's Triton
kernel, runtime/fp8kernel.py, in a CUDA graph with the rest of the pack: what bind() does on CUDA), "fused-nograph",
"eager" (fused=False: the reference quantizer box by box, then the ordinary replay). The fused buffer is checked equal
to the eager one (the GPU tier, tests/gpu, checks both against the CPU reference) before timing. Also: the
QuantizingReplayer's build time for the layer and for the whole rank (CPU work).

    python bench/quant_bench.py [--iters 20] [--json FILE]   (CUDA events, warm-up, medians of interleaved rounds)
    python bench/quant_bench.py --build-only [--repeat 3]      (any machine: the build alone, wall and CPU time)
    python bench/quant_bench.py --sharded 2                    (+ trainer rank 0 of 2 whole-block row shards' pack)
    python bench/quant_bench.py --cut 3                        (+ trainer rank 0 of 3 even row shards, which cut
                                                                blocks: the amax exchange's steps, staging, pack)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_cases import PlanLayer, _plan_file  # noqa: E402

from shardplan.plan.names import is_scale  # noqa: E402
from shardplan.runtime import fp8kernel  # noqa: E402
from shardplan.runtime.quantize import SCALE_SUFFIX, QuantizingReplayer  # noqa: E402
from shardplan.runtime.shards import local_tensors, plan_shards, tp_shards  # noqa: E402
from shardplan.sync import ShardedPacker  # noqa: E402

CASES = [
    ("plans/kimi-k2-fp8--tp16-ep--bfloat16.plan", 0, 3),
    ("plans/kimi-k2-fp8--tp8-ep--bfloat16.plan", 0, 3),
    ("plans/qwen3-30b-a3b-fp8--tp4--bfloat16.plan", 1, 3),
]


def trainer_tensors(replayer: QuantizingReplayer, sources, device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name in sorted(replayer.sources_read()):
        meta = sources[name]
        t = torch.randn(meta.shape, generator=gen, device=device)
        if t.dim() == 2:  # per-128-row magnitudes: distinct scales per block
            t *= (
                torch.rand((-(-t.shape[0] // 128), 1), generator=gen, device=device).repeat_interleave(128, 0)[
                    : t.shape[0]
                ]
                * 8
            )
        out[name] = t.to(torch.bfloat16 if meta.dtype == "float8_e4m3fn" else getattr(torch, meta.dtype))
    return out


def traffic(replayer: QuantizingReplayer, tensors) -> int:
    """Bytes any implementation moves: quantized boxes read, every segment written, unquantized segments read."""
    total = 0
    for weight in replayer.quantized:
        (r0, r1), (c0, c1) = replayer.boxes[weight]
        total += (r1 - r0) * (c1 - c0) * tensors[weight].element_size()
    table = replayer.layout.segments
    by_rank = {p.rank: p for p in replayer.plans}
    for i in range(len(table)):
        ref = int(table.ref_start[i])
        w = by_rank[int(table.ref_rank[ref])].writes[int(table.ref_index[ref])]
        quantized = any(n.removesuffix(SCALE_SUFFIX) in replayer.boxes for n in _names(w))
        total += int(table.nbytes[i]) * (1 if quantized else 2)
    return total


def _names(w):
    from shardplan.plan import ir

    return ir.sources(w.src.leaf)


def medians(fns: dict, iters: int) -> dict[str, float]:
    """Median ms of each fn over interleaved rounds (CUDA events; a round runs each once)."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in times.items()}


def measure(label, replayer, sources, args, dev, build_layer, build_rank) -> dict:
    """One row: the replayer's pack (fused in a graph, fused without, eager) vs a same-run copy of the same bytes."""
    tensors = trainer_tensors(replayer, sources, dev)
    fused = replayer.bind(tensors)
    assert fused.kernel is not None, fused.fused_error
    nograph = replayer.bind(tensors, cuda_graph=False)
    eager = replayer.bind(tensors, fused=False)
    if not torch.equal(fused.pack(), eager.pack()) or not torch.equal(nograph.pack(), eager.out):
        raise SystemExit(f"MISMATCH: {label}: the fused kernel's buffer differs from the eager quantizer's")
    moved = traffic(replayer, tensors)
    src = torch.empty(moved // 2, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    ms = medians(
        {
            "copy": lambda d=dst, s=src: d.copy_(s),
            "fused": fused.pack,
            "nograph": nograph.pack,
            "kernel": fused.kernel.launch,
            # a source handing new tensors every sync (gathered per layer, full_tensor()): bound again per pack
            "oneshot": lambda t=tensors, o=torch.empty_like(fused.out): replayer.bind(t, o).pack(),
            "oneshot_nograph": lambda t=tensors, o=torch.empty_like(fused.out): replayer.bind(
                t, o, cuda_graph=False
            ).pack(),
        },
        args.iters,
    )
    ms.update({"eager": medians({"eager": eager.pack}, args.eager_iters)["eager"]})
    row = dict(
        case=label,
        gb=moved / 1e9,
        build_layer_ms=build_layer,
        build_rank_ms=build_rank,
        launches=fused.num_launches,
        programs=fused.kernel.num_programs,
        **{f"{k}_ms": v for k, v in ms.items()},
        **{f"{k}_pct": 100 * ms["copy"] / v for k, v in ms.items() if k != "copy"},
    )
    print(
        f"| {label} | {row['gb']:.3f} | {ms['copy']:.3f} | {ms['fused']:.3f} ({row['fused_pct']:.0f}%) | "
        f"{ms['nograph']:.3f} ({row['nograph_pct']:.0f}%) | {ms['eager']:.1f} ({row['eager_pct']:.1f}%) | "
        f"{row['launches']} | {build_layer:.0f} / {build_rank:.0f} |",
        flush=True,
    )
    print(
        f"#   kernel launches alone (quantize + scale gather, no rest, no host check): {ms['kernel']:.3f} ms = "
        f"{row['kernel_pct']:.0f}% of copy; {row['programs']} programs in {len(fused.kernel.launches)} launches"
    )
    print(
        f"#   bound again per pack (a source handing new tensors every sync): bind + pack {ms['oneshot']:.3f} ms "
        f"({row['oneshot_pct']:.0f}% of copy), without the graph {ms['oneshot_nograph']:.3f} ms "
        f"({row['oneshot_nograph_pct']:.0f}%)"
    )
    del fused, nograph, eager, tensors, src, dst
    torch.cuda.empty_cache()
    return row


def measure_cut(label, case, layer, quantizer, trainers, args, dev) -> dict:
    """Trainer rank 0 of `trainers` even row splits (FSDP2's Shard(0), cutting 128-blocks) packing one layer for one
    consumer, as a sync does it each version: its partial block amaxes (staged copy + amax + host read), combining
    every holder's (host), staging its tensors with the amaxes planted (copy + plant + check), then the quantizing
    pack of the staged tensors, bound once (what one-shot binds per sync add is not in it). Next to a same-run copy of
    the pack's bytes."""
    held = {n: m for n, m in case.sources.items() if not is_scale(n)}
    shards = tp_shards(held, trainers, lambda n: 0 if len(held[n].shape) == 2 else None)
    sharded = plan_shards([case.plan()], case.sources, shards, quantizer=quantizer)
    packers = {t: ShardedPacker(sharded, t, device=dev) for t in sorted({s.rank for s in shards})}
    gen = torch.Generator(device=dev).manual_seed(0)
    full = {n: torch.randn(m.shape, generator=gen, device=dev).to(torch.bfloat16) for n, m in held.items()}
    group = f"layers.{layer}"
    local = {t: local_tensors(shards, t, full) for t in packers}
    partials = {t: p.partial_amaxes(group, local[t]) for t, p in packers.items()}
    me = packers[0]
    me.set_amaxes(group, partials)
    staged = me.stage(group, local[0])
    replayer = me.replayers[case.rank]
    bound = replayer.bind({n: staged[n] for n in replayer.sources_read()})
    moved = traffic(replayer, staged)
    src = torch.empty(moved // 2, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    ms = medians(
        {
            "copy": lambda: dst.copy_(src),
            "partial": lambda: me.partial_amaxes(group, local[0]),
            "combine": lambda: me.set_amaxes(group, partials),
            "stage": lambda: me.stage(group, local[0]),
            "pack": bound.pack,
            # what a sync does: the staged tensors are new every version, so each pack binds them again
            "oneshot": lambda o=torch.empty_like(bound.out): replayer.bind(
                {n: staged[n] for n in replayer.sources_read()}, o
            ).pack(),
            "oneshot_nograph": lambda o=torch.empty_like(bound.out): replayer.bind(
                {n: staged[n] for n in replayer.sources_read()}, o, cuda_graph=False
            ).pack(),
        },
        args.iters,
    )
    total = ms["partial"] + ms["combine"] + ms["stage"] + ms["pack"]
    cut = sum(c.held != c.padded for c in sharded.cut.get(0, {}).values())
    row = dict(case=label, gb=moved / 1e9, cut_weights=cut, total_ms=total, **{f"{k}_ms": v for k, v in ms.items()})
    print(
        f"| {label} | {row['gb']:.3f} | {cut} | {ms['copy']:.3f} | {ms['partial']:.3f} | {ms['combine']:.3f} | "
        f"{ms['stage']:.3f} | {ms['pack']:.3f} ({100 * ms['copy'] / ms['pack']:.0f}%) | {total:.3f} "
        f"({100 * ms['copy'] / total:.0f}%) |",
        flush=True,
    )
    print(
        f"#   the pack bound again per sync (staged tensors are new each version): bind + pack {ms['oneshot']:.3f} "
        f"ms, without the graph {ms['oneshot_nograph']:.3f} ms (bound once: {ms['pack']:.3f} ms)"
    )
    return row  # (its tensors go with this frame; main() empties the cache after)


def build_only(args) -> None:
    """The device-independent part of a consumer rank's quantizing replay: instantiating the rank's plan from the plan
    file, then building the QuantizingReplayer (plan geometry, rebased plans, the inner Replayer's layout and
    batches). Binding (views, the fused kernel's program table, the CUDA graph) is per device and not in it."""
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; medians "
        f"of {args.repeat} builds; wall ms / CPU ms (process time); bar: <= 100 ms per consumer rank"
    )
    print("| case | writes | instantiate rank | QuantizingReplayer build |")
    print("|---|---|---|---|")
    rows = []
    for path, rank, _ in CASES:
        plan_file = _plan_file(path)
        times = {"instantiate": [], "build": []}
        for _ in range(args.repeat):
            plan_file._cache.pop(rank, None)  # cold: a trainer instantiates (and builds) its rank once
            w0, c0 = time.perf_counter(), time.process_time()
            plan = plan_file.rank(rank)
            w1, c1 = time.perf_counter(), time.process_time()
            QuantizingReplayer(plan, plan_file.sources, quantizer=plan_file.header.quantizer)
            w2, c2 = time.perf_counter(), time.process_time()
            times["instantiate"].append(((w1 - w0) * 1e3, (c1 - c0) * 1e3))
            times["build"].append(((w2 - w1) * 1e3, (c2 - c1) * 1e3))
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
        row = dict(
            case=f"{Path(path).stem} rank {rank}",
            writes=len(plan.writes),
            **{f"{k}_{m}_ms": med[k][i] for k in med for i, m in enumerate(("wall", "cpu"))},
        )
        rows.append(row)
        print(
            f"| {row['case']} | {row['writes']} | {med['instantiate'][0]:.0f} / {med['instantiate'][1]:.0f} | "
            f"{med['build'][0]:.0f} / {med['build'][1]:.0f} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(dict(torch=torch.__version__, argv=sys.argv, rows=rows), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--eager-iters", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--warps", type=int, default=None, help="the kernel's num_warps (default fp8kernel.NUM_WARPS)")
    ap.add_argument(
        "--build-only",
        action="store_true",
        help="time only building one consumer rank's QuantizingReplayer (CPU work; no GPU needed)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="builds per case with --build-only (median reported)")
    ap.add_argument(
        "--sharded",
        type=int,
        default=0,
        help="also time trainer rank 0's pack when N trainer ranks hold whole-block row shards (ShardedPacker)",
    )
    ap.add_argument(
        "--cut",
        type=int,
        default=0,
        help="also time trainer rank 0 of N even row shards that cut blocks (amax exchange steps, staging, pack)",
    )
    args = ap.parse_args()
    if args.build_only:
        return build_only(args)
    if args.warps:
        fp8kernel.NUM_WARPS = args.warps
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    dev = torch.device("cuda")
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; QuantizingReplayer.pack of one layer vs a "
        f"same-run copy_ of the same bytes (read + written), medians of {args.iters} interleaved rounds; "
        f"kernel num_warps {fp8kernel.NUM_WARPS}"
    )
    print(
        "| case | GB moved | copy ms | fused ms (% copy) | fused, no graph ms (% copy) | eager ms (% copy) | "
        "launches | build layer / rank ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for path, rank, layer in CASES:
        plan_file = _plan_file(path)
        case = PlanLayer(path, rank, layer)
        t0 = time.perf_counter()
        replayer = QuantizingReplayer(case.plan(), case.sources, quantizer=plan_file.header.quantizer)
        build_layer = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        QuantizingReplayer(plan_file.rank(rank), plan_file.sources, quantizer=plan_file.header.quantizer)
        build_rank = (time.perf_counter() - t0) * 1e3
        rows.append(measure(case.label, replayer, case.sources, args, dev, build_layer, build_rank))
        if args.sharded:  # what trainer rank 0 of a whole-block TP split packs for this consumer (ShardedPacker)
            held = {n: m for n, m in case.sources.items() if not is_scale(n)}  # a trainer holds no scales
            shards = tp_shards(
                held, args.sharded, lambda n: 0 if len(held[n].shape) == 2 else None, block=lambda n: 128
            )
            t0 = time.perf_counter()
            sharded = plan_shards([case.plan()], case.sources, shards, quantizer=plan_file.header.quantizer)
            replayer = ShardedPacker(sharded, 0).replayers[rank]
            build = (time.perf_counter() - t0) * 1e3
            label = f"{case.label}, trainer 0 of {args.sharded} (whole-block rows)"
            rows.append(measure(label, replayer, sharded.sources[0], args, dev, build, float("nan")))
    if args.cut:
        print(
            f"\n# trainer rank 0 of {args.cut} even row shards (blocks cut between trainers), per sync: partial "
            f"amaxes, combine (host), stage + plant, pack of the staged tensors (fused, graph); % = copy / that"
        )
        print("| case | GB moved | cut weights | copy ms | partial ms | combine ms | stage ms | pack ms | total ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        for path, rank, layer in CASES:
            case = PlanLayer(path, rank, layer)
            quantizer = _plan_file(path).header.quantizer
            label = f"{case.label}, trainer 0 of {args.cut}"
            rows.append(measure_cut(label, case, layer, quantizer, args.cut, args, dev))
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                dict(device=torch.cuda.get_device_name(), torch=torch.__version__, argv=sys.argv, rows=rows), indent=1
            )
        )


if __name__ == "__main__":
    main()
