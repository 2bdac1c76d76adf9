"""Replay + pack and apply bandwidth against the same-run copy ceiling.

    python bench/replay_bench.py --device cpu            # 2-core CI box: Kimi no-EP uses 24 experts (see --experts)
    python bench/replay_bench.py --device cuda           # H200: full 384 experts

Plans: until the recorder produces real plan files, the plans are synthesized here by `PlanBuilder`, which mimics
what vLLM's loaders record (narrow of the HF tensor copied into a narrow of the fused param): Kimi-K2 decoder layer 1
(MLA attention, 384 experts, 1 shared expert) for a TP32 rank with and without EP, and a Llama-3.1-70B layer for a
TP8 rank. `--plan FILE[,FILE]` adds one decoder layer of a recorded plan file (bench/plan_cases.py).

Bytes counted like the ceiling: bytes read + bytes written (pack: source bytes read + packed bytes written; apply:
packed bytes read + param bytes written). Padding is not counted. CUDA: events, warm-up, median of --iters runs;
correctness (pack + apply == reference interpreter on CPU copies, bitwise) is checked before timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from shardplan.plan import ir  # noqa: E402  # noqa: E402
from shardplan.plan.interp import apply_reference, eval_view, region_view, to_dtype, write_source  # noqa: E402
from shardplan.runtime import tensors as rt_tensors  # noqa: E402
from shardplan.runtime.apply import Applier, params_from_plan  # noqa: E402
from shardplan.runtime.replay import Replayer  # noqa: E402
from shardplan.sync.adapters import _same_tensors  # noqa: E402


# ---- plan synthesis (mimics vLLM's recorded loaders) ---------------------------------------------------------------
def box(shape: tuple[int, ...], starts: tuple[int, ...], sizes: tuple[int, ...]) -> ir.Region:
    """Region of x[s0:s0+n0, s1:s1+n1, ...] for a contiguous x of `shape`."""
    strides = ir.contiguous_strides(shape)
    return ir.Region(sum(s * st for s, st in zip(starts, strides)), tuple(sizes), strides)


def narrow(shape: tuple[int, ...], dim: int, start: int, length: int) -> ir.Region:
    starts = [0] * len(shape)
    sizes = list(shape)
    starts[dim], sizes[dim] = start, length
    return box(shape, tuple(starts), tuple(sizes))


@dataclass
class PlanBuilder:
    rank: int
    params: dict[str, ir.TensorMeta] = field(default_factory=dict)
    sources: dict[str, ir.TensorMeta] = field(default_factory=dict)
    writes: list[ir.Write] = field(default_factory=list)

    def param(self, name: str, shape: tuple[int, ...], dtype: str = "bfloat16") -> str:
        self.params[name] = ir.TensorMeta(name, tuple(shape), dtype)
        return name

    def source(self, name: str, shape: tuple[int, ...], dtype: str = "bfloat16") -> str:
        self.sources[name] = ir.TensorMeta(name, tuple(shape), dtype)
        return name

    def copy(self, param: str, dst: ir.Region, source: str, src: ir.Region) -> None:
        self.writes.append(ir.Write(param, dst, ir.View(ir.Source(source), src)))

    def shard_rows(self, param: str, dst_row: int, source: str, row: int, num_rows: int) -> None:
        """param[dst_row:dst_row+n] <- source[row:row+n] (column-parallel / merged-column loaders)."""
        p, s = self.params[param].shape, self.sources[source].shape
        self.copy(param, narrow(p, 0, dst_row, num_rows), source, narrow(s, 0, row, num_rows))

    def shard_cols(self, param: str, source: str, col: int, num_cols: int) -> None:
        """param[:, :] <- source[:, col:col+n] (row-parallel loaders)."""
        p, s = self.params[param].shape, self.sources[source].shape
        self.copy(param, ir.full_region(p), source, narrow(s, 1, col, num_cols))

    def replicate(self, param: str, source: str) -> None:
        self.copy(param, ir.full_region(self.params[param].shape), source, ir.full_region(self.sources[source].shape))

    def plan(self) -> ir.RankPlan:
        return ir.RankPlan(self.rank, tuple(self.params.values()), tuple(self.writes))


def llama70b_layer(layer: int = 0, tp: int = 8, rank: int = 0) -> PlanBuilder:
    hidden, num_heads, num_kv_heads, head_dim, inter = 8192, 64, 8, 128, 28672
    b, pre = PlanBuilder(rank), f"model.layers.{layer}."
    q_rows, kv_rows, i_rows = num_heads * head_dim // tp, max(num_kv_heads // tp, 1) * head_dim, inter // tp
    qkv = b.param(pre + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, hidden))
    for k, (name, rows, dst_row) in enumerate(
        [
            ("q", num_heads * head_dim, 0),
            ("k", num_kv_heads * head_dim, q_rows),
            ("v", num_kv_heads * head_dim, q_rows + kv_rows),
        ]
    ):
        src = b.source(pre + f"self_attn.{name}_proj.weight", (rows, hidden))
        n = q_rows if k == 0 else kv_rows
        b.shard_rows(qkv, dst_row, src, rank * n % rows, n)
    o = b.param(pre + "self_attn.o_proj.weight", (hidden, num_heads * head_dim // tp))
    b.shard_cols(o, b.source(pre + "self_attn.o_proj.weight", (hidden, num_heads * head_dim)), rank * q_rows, q_rows)
    gate_up = b.param(pre + "mlp.gate_up_proj.weight", (2 * i_rows, hidden))
    for k, name in enumerate(["gate", "up"]):
        src = b.source(pre + f"mlp.{name}_proj.weight", (inter, hidden))
        b.shard_rows(gate_up, k * i_rows, src, rank * i_rows, i_rows)
    down = b.param(pre + "mlp.down_proj.weight", (hidden, i_rows))
    b.shard_cols(down, b.source(pre + "mlp.down_proj.weight", (hidden, inter)), rank * i_rows, i_rows)
    for norm in ["input_layernorm", "post_attention_layernorm"]:
        b.replicate(b.param(pre + norm + ".weight", (hidden,)), b.source(pre + norm + ".weight", (hidden,)))
    return b


def kimi_k2_layer(
    layer: int = 1, tp: int = 32, rank: int = 0, ep: bool = False, num_experts: int = 384, experts_per_rank: int = 12
) -> PlanBuilder:
    hidden, num_heads, q_lora, kv_lora, nope, rope, v_dim, moe_inter = 7168, 64, 1536, 512, 128, 64, 128, 2048
    b, pre = PlanBuilder(rank), f"model.layers.{layer}."
    att = pre + "self_attn."
    fused = b.param(att + "fused_qkv_a_proj.weight", (q_lora + kv_lora + rope, hidden))
    b.shard_rows(fused, 0, b.source(att + "q_a_proj.weight", (q_lora, hidden)), 0, q_lora)
    kv_a = b.source(att + "kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden))
    b.shard_rows(fused, q_lora, kv_a, 0, kv_lora + rope)
    for norm, dim in [("q_a_layernorm", q_lora), ("kv_a_layernorm", kv_lora)]:
        b.replicate(b.param(att + norm + ".weight", (dim,)), b.source(att + norm + ".weight", (dim,)))
    heads = num_heads // tp
    for name, rows_per_head, cols in [("q_b_proj", nope + rope, q_lora), ("kv_b_proj", nope + v_dim, kv_lora)]:
        n = heads * rows_per_head
        p = b.param(att + name + ".weight", (n, cols))
        b.shard_rows(p, 0, b.source(att + name + ".weight", (num_heads * rows_per_head, cols)), rank * n, n)
    o = b.param(att + "o_proj.weight", (hidden, heads * v_dim))
    b.shard_cols(o, b.source(att + "o_proj.weight", (hidden, num_heads * v_dim)), rank * heads * v_dim, heads * v_dim)
    mlp = pre + "mlp."
    router = mlp + "gate.weight"
    b.replicate(b.param(router, (num_experts, hidden)), b.source(router, (num_experts, hidden)))
    bias = mlp + "gate.e_score_correction_bias"
    b.replicate(b.param(bias, (num_experts,), "float32"), b.source(bias, (num_experts,), "float32"))
    if ep:
        local = list(range(rank * experts_per_rank, (rank + 1) * experts_per_rank))
        inter, first_row = moe_inter, 0
    else:
        local = list(range(num_experts))
        inter, first_row = moe_inter // tp, rank * (moe_inter // tp)
    w13 = b.param(mlp + "experts.w13_weight", (len(local), 2 * inter, hidden))
    w2 = b.param(mlp + "experts.w2_weight", (len(local), hidden, inter))
    for slot, e in enumerate(local):
        ex = mlp + f"experts.{e}."
        for k, name in enumerate(["gate_proj", "up_proj"]):
            src = b.source(ex + name + ".weight", (moe_inter, hidden))
            b.copy(
                w13,
                box(b.params[w13].shape, (slot, k * inter, 0), (1, inter, hidden)),
                src,
                narrow((moe_inter, hidden), 0, first_row, inter),
            )
        src = b.source(ex + "down_proj.weight", (hidden, moe_inter))
        b.copy(
            w2,
            box(b.params[w2].shape, (slot, 0, 0), (1, hidden, inter)),
            src,
            narrow((hidden, moe_inter), 1, first_row, inter),
        )
    # vLLM's fused-MoE loader squeezes nothing: the dst box keeps the expert dim of size 1, the source has none
    b.writes = [
        ir.Write(w.param, ir.Region(w.dst.offset, w.dst.sizes[1:], w.dst.strides[1:]), w.src)
        if w.param in (w13, w2)
        else w
        for w in b.writes
    ]
    shared_inter = moe_inter // tp
    gate_up = b.param(mlp + "shared_experts.gate_up_proj.weight", (2 * shared_inter, hidden))
    for k, name in enumerate(["gate_proj", "up_proj"]):
        b.shard_rows(
            gate_up,
            k * shared_inter,
            b.source(mlp + f"shared_experts.{name}.weight", (moe_inter, hidden)),
            rank * shared_inter,
            shared_inter,
        )
    down = b.param(mlp + "shared_experts.down_proj.weight", (hidden, shared_inter))
    b.shard_cols(
        down, b.source(mlp + "shared_experts.down_proj.weight", (hidden, moe_inter)), rank * shared_inter, shared_inter
    )
    for norm in ["input_layernorm", "post_attention_layernorm"]:
        b.replicate(b.param(pre + norm + ".weight", (hidden,)), b.source(pre + norm + ".weight", (hidden,)))
    return b


def tiny_boxes(num_boxes: int = 4096) -> PlanBuilder:
    """Worst case for per-box overhead: every box from its own tensor into its own param (512 B each)."""
    b = PlanBuilder(0)
    for i in range(num_boxes):
        p = b.param(f"model.layers.0.tiny.{i}", (4, 64))
        b.shard_rows(p, 0, b.source(f"model.layers.0.src.{i}", (8, 64)), 4, 4)
    return b


# ---- tensors ---------------------------------------------------------------------------------------------------------
def make_tensors(
    sources: dict[str, ir.TensorMeta], device: str, stacked_experts: bool = False
) -> dict[str, torch.Tensor]:
    """Random trainer tensors. stacked_experts: experts live in [E, ...] tensors (w1/w3/w2, torchtitan-style) and the
    HF names are views of them, so the replay's same-storage path applies."""
    gen = torch.Generator(device=device).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    stacks: dict[tuple, list[str]] = {}
    for name, meta in sources.items():
        parts = name.split(".")
        if stacked_experts and "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            key = (".".join(parts[: parts.index("experts") + 1]), parts[-2])
            stacks.setdefault(key, []).append(name)
            continue
        tensors[name] = torch.randn(meta.shape, generator=gen, device=device).to(to_dtype(meta.dtype))
    for names in stacks.values():
        meta = sources[names[0]]
        stack = torch.randn((len(names),) + meta.shape, generator=gen, device=device).to(to_dtype(meta.dtype))
        tensors.update({n: stack[i] for i, n in enumerate(names)})
    return tensors


# ---- timing ----------------------------------------------------------------------------------------------------------
def traffic(replayer: Replayer) -> tuple[int, int]:
    """(pack bytes read + written, apply bytes read + written), padding excluded."""
    pack = apply = 0
    for seg in replayer.layout.segments:
        w = replayer._write(seg.refs[0])
        src_itemsize = to_dtype(replayer.sources[w.src.leaf.name].dtype).itemsize if ir.is_pure_view(w) else 0
        pack += seg.nbytes + math.prod(seg.shape) * src_itemsize
        apply += 2 * seg.nbytes * len(seg.refs)
    return pack, apply


def naive_apply(plan: ir.RankPlan, layout, params, buffer: torch.Tensor):
    """One Python copy_ per write: the baseline the batched Applier is compared with."""
    views = []
    for seg in layout.segments:
        src = buffer[seg.offset : seg.offset + seg.nbytes].view(to_dtype(seg.dtype)).view(seg.shape)
        for ref in seg.refs:
            views.append((region_view(params[ref.param], plan.writes[ref.index].dst), src))

    def run():
        for d, s in views:
            d.copy_(s)

    return run


class NaivePack:
    """The baselines the batched pack is compared with, built from the runtime's public API only: "loop" is one
    Python copy_ per segment (what replaying a plan write by write costs), "foreach" one torch._foreach_copy_ over
    every segment. Source views are made once, like a binding's."""

    def __init__(self, replayer: Replayer, tensors, out: torch.Tensor, strategy: str):
        self.out, dsts, srcs = out, [], []
        plans = {p.rank: p for p in replayer.plans}
        for seg in replayer.layout.segments:
            if not seg.nbytes:
                continue
            w = plans[seg.refs[0].rank].writes[seg.refs[0].index]
            dtype = to_dtype(seg.dtype)
            dsts.append(out[seg.offset : seg.offset + seg.nbytes].view(dtype).view(seg.shape))
            srcs.append(
                eval_view(w.src, tensors).expand(w.dst.sizes) if ir.is_pure_view(w) else write_source(w, dtype, tensors)
            )
        if strategy == "foreach":
            self.ops = [lambda: torch._foreach_copy_(dsts, srcs)] if dsts else []
        elif strategy == "loop":
            self.ops = [lambda d=d, s=s: d.copy_(s) for d, s in zip(dsts, srcs)]
        else:
            raise ValueError(f"unknown baseline {strategy!r}: 'loop' or 'foreach'")
        self.num_launches, self.graph_error = len(self.ops), None

    def pack(self, check: bool = True) -> torch.Tensor:
        with torch.no_grad():
            for op in self.ops:
                op()
        return self.out


def check_bitwise(plan: ir.RankPlan, tensors, params, device: str) -> None:
    """pack + apply result (params, on device) == reference interpreter on CPU copies, bit for bit."""
    cpu_tensors = {n: t.cpu() for n, t in tensors.items()}
    ref = params_from_plan(plan, "cpu", fill=float("nan"))
    apply_reference(plan, cpu_tensors, ref)
    for name, t in params.items():
        got, want = t.cpu(), ref[name]
        if not torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
            raise SystemExit(f"MISMATCH in {name}: batched pack + apply differs from the reference interpreter")


def interleaved_medians(fns: dict, device: str, iters: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each fn, timed in interleaved rounds (one call of each per round), so that a noisy machine
    (a shared CPU box) slows every contender alike rather than whichever ran during the noise."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for key, fn in fns.items():
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[key].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_case(label: str, builder: PlanBuilder, args, stacked: bool = False) -> list[dict]:
    device = args.device
    plan = builder.plan()
    tensors = make_tensors(builder.sources, device, stacked_experts=stacked)
    replayer = Replayer(plan, builder.sources)
    pack_bytes, apply_bytes = traffic(replayer)
    params = params_from_plan(plan, device, fill=float("nan"))
    applier = Applier(plan, replayer.layout, params, cuda_graph=False)
    # "batched+graph": the torch copies captured (box_copy=False); "box+graph": the copies as one Triton box-copy
    # launch in the graph (runtime/copykernel.py), bind()'s and Applier's default on CUDA
    graph_applier = (
        Applier(plan, replayer.layout, params, cuda_graph=True, box_copy=False) if device == "cuda" else None
    )
    box_applier = Applier(plan, replayer.layout, params, cuda_graph=True, box_copy=True) if device == "cuda" else None
    bound = replayer.bind(tensors, cuda_graph=False)
    applier.apply(bound.pack())
    if not args.no_check:
        check_bitwise(plan, tensors, params, device)
    reference_buffer = bound.out.clone()
    # "batched" = eager launches (cuda_graph=False)
    # "graph 8 streams": the graph's torch copies captured on up to 8 forked streams, overlapping (runtime.tensors
    # .GRAPH_BRANCHES = 8); "batched+graph" one after another
    cuda = ["batched+graph", "graph 8 streams", "box+graph"] if device == "cuda" else []
    strategies = ["batched"] + cuda + ["foreach", "loop"]
    bounds = {}
    for strategy in strategies:
        try:
            if strategy in ("foreach", "loop"):
                b = NaivePack(replayer, tensors, torch.zeros_like(reference_buffer), strategy)
            else:
                with streams(8 if strategy == "graph 8 streams" else None):
                    b = replayer.bind(tensors, cuda_graph="graph" in strategy, box_copy=strategy.startswith("box"))
            if "graph" in strategy and b.graph_error:
                raise RuntimeError(b.graph_error)
            if strategy.startswith("box") and b.box_copy is None:
                raise RuntimeError(f"no box copy: {b.box_copy_error}")
            b.pack()
        except Exception as exc:  # keep the other strategies' numbers if one path fails on this device
            print(f"# {label}: strategy {strategy} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        if not torch.equal(b.out, reference_buffer):
            raise SystemExit(f"MISMATCH: {label} strategy {strategy} packs different bytes")
        bounds[strategy] = b
    src = torch.empty(args.ceiling_mib << 20, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    # the same bytes as the pack (and the apply) moved by one contiguous copy_: no ceiling is closer to the work
    same = {
        k: torch.empty(n // 2, dtype=torch.uint8, device=device).random_()
        for k, n in (("pack", pack_bytes), ("apply", apply_bytes))
    }
    same_dst = {k: torch.empty_like(v) for k, v in same.items()}
    # check=False: the staleness check is host-side Python, reported separately below
    # F821 silenced below: these closures only run in interleaved_medians, before `del src, dst, same, same_dst` and
    # `del ..., bound` free the buffers (the del clears the closure cells too, so the memory is released)
    fns = {
        "ceiling": lambda: dst.copy_(src),  # noqa: F821
        "copy-pack": lambda: same_dst["pack"].copy_(same["pack"]),  # noqa: F821
        "copy-apply": lambda: same_dst["apply"].copy_(same["apply"]),  # noqa: F821
    }
    fns.update({s: (lambda b=b: b.pack(check=False)) for s, b in bounds.items()})
    fns["apply"] = lambda: applier.apply(bound.out)  # noqa: F821
    if graph_applier is not None:
        graph_applier.apply(bound.out)
        fns["apply+graph"] = lambda: graph_applier.apply(bound.out)  # noqa: F821
        branched_applier = Applier(plan, replayer.layout, params, cuda_graph=True, box_copy=False)
        with streams(8):
            branched_applier.apply(bound.out)
        fns["apply+graph8"] = lambda: branched_applier.apply(bound.out)  # noqa: F821
        # the staleness check as a pack pays it: on the host while the GPU replays the graph
        fns["graph+check"] = lambda b=bounds["batched+graph"]: b.pack(check=True)
        want = {n: t.clone() for n, t in params.items()}  # what the checked eager apply wrote
        for t in params.values():
            t.view(-1).view(torch.uint8).fill_(0xFF)
        box_applier.apply(bound.out)
        if box_applier.box_copy_error:
            print(f"# {label}: apply through the box copy failed: {box_applier.box_copy_error}", flush=True)
        elif any(
            not torch.equal(t.view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8)) for n, t in params.items()
        ):
            raise SystemExit(f"MISMATCH: {label} apply through the box copy differs from the eager apply")
        del want
        fns["apply+box"] = lambda: box_applier.apply(bound.out)  # noqa: F821
    fns["apply-naive"] = naive_apply(plan, replayer.layout, params, bound.out)
    # a source handing new tensors every sync (gathered per layer, full_tensor()): the sync binds them per pack
    # (into a given buffer, as the sync's staging slot)
    fns["oneshot"] = lambda t=tensors, o=torch.empty_like(reference_buffer): replayer.bind(t, o).pack()
    if device == "cuda":
        fns["oneshot-nograph"] = lambda t=tensors, o=torch.empty_like(reference_buffer): replayer.bind(
            t, o, cuda_graph=False
        ).pack()
    seconds = interleaved_medians(fns, device, args.iters)
    print(
        f"# {label}: bound again per pack (bind + pack, the default options) {seconds['oneshot'] * 1e3:.3f} ms"
        + (f", without the graph {seconds['oneshot-nograph'] * 1e3:.3f} ms" if "oneshot-nograph" in seconds else "")
        + f"; a same-size copy {seconds['copy-pack'] * 1e3:.3f} ms",
        flush=True,
    )
    ceiling = 2 * src.numel() / seconds["ceiling"]
    del src, dst, same, same_dst
    check_us = statistics.median(_timed(bound.check) for _ in range(200)) * 1e6
    # the sync packer's test that the source handed the bound tensors again (its identity pass), before check()
    names = sorted(replayer.sources_read())
    bound.given = tuple(bound.tensors[n] for n in names)
    same_us = statistics.median(_timed(lambda b=bound, t=tensors: _same_tensors(b, names, t)) for _ in range(200)) * 1e6
    if args.profile_ops and "batched" in bounds:
        ops = bounds["batched"]._ops
        op_seconds = interleaved_medians({i: op for i, op in enumerate(ops)}, device, args.iters)
        for i, op in enumerate(ops):
            print(f"#   op {i}: {op_seconds[i] * 1e6:8.1f} us  {getattr(op, 'label', '?')}", flush=True)
    rows = []
    for strategy, b in bounds.items():
        row = dict(
            case=label,
            strategy=strategy,
            mib=replayer.layout.nbytes / 2**20,
            writes=len(plan.writes),
            tensors=len(bound.tensors),
            launches=b.num_launches,
            ceiling_gbps=ceiling / 1e9,
            pack_ms=seconds[strategy] * 1e3,
            pack_gbps=pack_bytes / seconds[strategy] / 1e9,
        )
        apply_key = {
            "batched": "apply",
            "batched+graph": "apply+graph",
            "graph 8 streams": "apply+graph8",
            "box+graph": "apply+box",
            "loop": "apply-naive",
        }.get(strategy)
        if apply_key in seconds:
            launches = {"apply": applier.num_launches, "apply+graph": 1, "apply+graph8": 1, "apply+box": 1}.get(
                apply_key, len(plan.writes)
            )
            row.update(
                apply_ms=seconds[apply_key] * 1e3,
                apply_gbps=apply_bytes / seconds[apply_key] / 1e9,
                apply_launches=launches,
            )
        if strategy == "batched":
            row["check_us"] = check_us
            row["same_tensors_us"] = same_us
        if strategy == "batched+graph" and "graph+check" in seconds:
            row["visible_check_us"] = (seconds["graph+check"] - seconds[strategy]) * 1e6
        row["pack_pct"] = 100 * row["pack_gbps"] / row["ceiling_gbps"]
        row["copy_pack_ms"] = seconds["copy-pack"] * 1e3
        row["pack_pct_same"] = 100 * seconds["copy-pack"] / seconds[strategy]
        if "apply_gbps" in row:
            row["apply_pct"] = 100 * row["apply_gbps"] / row["ceiling_gbps"]
            row["copy_apply_ms"] = seconds["copy-apply"] * 1e3
            row["apply_pct_same"] = 100 * seconds["copy-apply"] / seconds[apply_key]
        rows.append(row)
        print(_fmt(row), flush=True)
    del bounds, tensors, params, bound
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def streams(n: int | None):
    """Graphs captured meanwhile fork each stage into up to `n` streams (runtime.tensors.GRAPH_BRANCHES)."""
    saved = rt_tensors.GRAPH_BRANCHES
    rt_tensors.GRAPH_BRANCHES = n or saved
    try:
        yield
    finally:
        rt_tensors.GRAPH_BRANCHES = saved


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _fmt(row: dict) -> str:
    apply = (
        f"{row['apply_gbps']:8.1f} {row['apply_pct']:5.0f}% {row['apply_pct_same']:5.0f}% {row['apply_launches']:6d}"
        if "apply_gbps" in row
        else f"{'':>8} {'':>6} {'':>6} {'':>6}"
    )
    return (
        f"| {row['case']:<34} | {row['strategy']:<15} | {row['mib']:8.1f} | {row['writes']:6d} | "
        f"{row['launches']:6d} | {row['ceiling_gbps']:7.1f} | {row['pack_gbps']:8.1f} {row['pack_pct']:5.0f}% "
        f"{row['pack_pct_same']:5.0f}% | {apply} |"
    )


# %copy: of the same-run 1 GiB copy's bandwidth; %same: of a same-run copy_ of the same bytes (time / time)
HEADER = (
    "| case                               | strategy        | MiB      | writes | launch | copy GB/s | "
    "pack GB/s  %copy  %same | applyGB/s %copy  %same launch |"
)


SEPARATOR = "|" + "|".join("---" for _ in range(HEADER.count("|") - 1)) + "|"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20, help="timed runs per measurement (median reported)")
    ap.add_argument(
        "--experts",
        type=int,
        default=None,
        help="routed experts in the Kimi no-EP case (default 384 on cuda, 24 on cpu: the trainer "
        "holds every expert's full tensor, 33.8 GB per layer at 384)",
    )
    ap.add_argument("--cases", default="llama,kimi-ep,kimi,kimi-stacked,tiny")
    ap.add_argument("--no-check", action="store_true", help="skip the bitwise check against the reference")
    ap.add_argument("--ceiling-mib", type=int, default=1024, help="size of the copy that gives the ceiling")
    ap.add_argument("--profile-ops", action="store_true", help="also time each op of the batched pack alone")
    ap.add_argument("--plan", default=None, help="also bench this recorded plan file (one layer of --plan-rank)")
    ap.add_argument("--plan-rank", type=int, default=0)
    ap.add_argument("--plan-layer", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    experts = args.experts or (384 if args.device == "cuda" else 24)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    print(
        f"# device {name}, torch {torch.__version__}; copy = {args.ceiling_mib} MiB copy_ (read + write), timed "
        f"interleaved with each case; medians of {args.iters}"
    )
    print(HEADER)
    print(SEPARATOR)
    cases = {
        "llama": ("llama-3.1-70b layer, TP8 rank 0", lambda: llama70b_layer(), False),
        "kimi-ep": ("kimi-k2 layer 1, TP32+EP rank 0", lambda: kimi_k2_layer(ep=True), False),
        "kimi": (f"kimi-k2 layer 1, TP32 rank 0, {experts}E", lambda: kimi_k2_layer(num_experts=experts), False),
        "kimi-stacked": ("  same, trainer experts [E,I,H]", lambda: kimi_k2_layer(num_experts=experts), True),
        "tiny": ("tiny: 4096 boxes x 512 B", lambda: tiny_boxes(), False),
    }
    if args.plan:
        from plan_cases import PlanLayer

        for path in args.plan.split(","):
            layer = PlanLayer(path, args.plan_rank, args.plan_layer)
            cases[f"plan:{path}"] = (layer.label, lambda layer=layer: layer, False)
            args.cases += f",plan:{path}"
    rows = []
    for key in [c for c in args.cases.split(",") if c]:
        label, build, stacked = cases[key]
        rows += bench_case(label, build(), args, stacked)
    for r in rows:
        if "check_us" in r:
            graph = next((g for g in rows if g["case"] == r["case"] and g["strategy"] == "box+graph"), r)
            print(
                f"# {r['case'].strip()}: bind-staleness check {r['check_us']:.1f} us per pack = "
                f"{100 * r['check_us'] / (graph['pack_ms'] * 1e3):.1f}% of the {graph['strategy']} pack "
                f"({graph['pack_ms']:.3f} ms); the sync's same-tensors pass {r['same_tensors_us']:.1f} us "
                f"({r['tensors']} tensors) = {100 * r['same_tensors_us'] / (graph['pack_ms'] * 1e3):.1f}%"
            )
        if "visible_check_us" in r:  # pack(check=True) - pack(check=False), both timed on the GPU, interleaved
            print(
                f"# {r['case'].strip()}: the check as the graph pack pays it (on the host beside the replay): "
                f"{r['visible_check_us']:.1f} us = {100 * r['visible_check_us'] / (r['pack_ms'] * 1e3):.1f}% of "
                f"the {r['strategy']} pack ({r['pack_ms']:.3f} ms)"
            )
    tiny = [r for r in rows if r["case"].startswith("tiny")]
    for r in tiny:
        print(
            f"# tiny boxes, {r['strategy']}: pack {r['pack_ms'] * 1e3 / 4096:.2f} us/box"
            + (f", apply {r['apply_ms'] * 1e3 / 4096:.2f} us/box" if "apply_ms" in r else "")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, argv=sys.argv, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
