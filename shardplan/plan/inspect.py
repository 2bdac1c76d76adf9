"""`shardplan inspect`: what a plan says, in numbers a person can check.

Bytes are counted in the destination dtype (what a consumer receives). The redundancy factor compares a full
broadcast (every rank receives every checkpoint tensor it has a stage for) with the plan's bytes for that rank. An FP8
plan (header `quantizer`) also gets its bytes per rank split into fp8 weights, f32 scales and the rest, next to what
the same layout moves in BF16.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.plan import ir
from shardplan.plan.body import PlanBody
from shardplan.plan.file.format import PlanFile, skeleton_ops
from shardplan.plan.ir import itemsize
from shardplan.plan.names import group_of, group_order, is_scale, slot_of
from shardplan.plan.template import trie_count


def _hole_layout(skeleton) -> dict:
    """Positions of the param-name holes and the dst size holes within a write skeleton's hole vector."""
    _, (_, param_text), (_, offset_t, sizes_t, strides_t), _ = skeleton
    num_name = param_text.count("{}") - 2 * param_text.count("{{}}")
    first_size = num_name + len(offset_t)
    return {"param_text": param_text, "num_name": num_name, "sizes": list(range(first_size, first_size + len(sizes_t)))}


def group_bytes(body: PlanBody, rank: int) -> dict[str, int]:
    """Bytes per weight group (decoder layer) a rank receives, from the templated body, vectorised: a write's group
    is its param's layer, which is variable 1 of every template."""
    return _rank_bytes(body, rank, by_layer=True)


def kind_bytes(body: PlanBody, rank: int) -> dict[str, int]:
    """Bytes a rank receives per kind of param: "fp8" (float8 weights), "scale" (their float32 `*_scale_inv`), and
    "other" (everything else, in its own dtype)."""
    return _rank_bytes(body, rank, by_layer=False)


def _kind(body: PlanBody, param: str) -> str:
    meta = body.params.get(param)
    if meta is not None and meta.dtype.startswith("float8"):
        return "fp8"
    return "scale" if is_scale(param) else "other"


def _rank_bytes(body: PlanBody, rank: int, by_layer: bool) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for g in body.groups:
        var_rows = g.instances(rank)
        if not len(var_rows):
            continue
        holes = g.coeffs[:, :1].T + var_rows @ g.coeffs[:, 1:].T
        info = _hole_layout(g.skeleton)
        numel = np.prod(holes[:, info["sizes"]], axis=1) if info["sizes"] else np.ones(len(holes), dtype=np.int64)
        first_name = _fill(info["param_text"], holes[0, : info["num_name"]].tolist())
        size = itemsize(body.params[first_name].dtype) if first_name in body.params else 2
        if not by_layer:  # a template's params share their name's suffix, hence their kind
            out[_kind(body, first_name)] += int(numel.sum()) * size
            continue
        layers, inverse = np.unique(var_rows[:, 1], return_inverse=True)
        sums = np.bincount(inverse.reshape(-1), weights=numel.astype(np.float64))
        for layer, total in zip(layers.tolist(), sums.tolist()):
            label = f"layers.{layer}" if layer >= 0 else group_of(first_name)
            out[label] += int(total) * size
    for w in body.ordered.get(rank, ()):
        key = group_of(w.param) if by_layer else _kind(body, w.param)
        out[key] += w.dst.numel * itemsize(body.params[w.param].dtype)
    for f in body.fallbacks.get(rank, ()):
        meta = body.sources[f.source]
        kind = "fp8" if meta.dtype.startswith("float8") else "scale" if is_scale(f.source) else "other"
        out[group_of(f.source) if by_layer else kind] += meta.numel * itemsize(meta.dtype)
    return dict(out)


def fp8_vs_bf16(body: PlanBody, ranks) -> list[str]:
    """Lines comparing an FP8 plan's bytes per rank with what the same layout moves in BF16, from the plan itself:
    an fp8 element is 2 bytes in BF16, and the scale tensors do not exist there."""
    lines = [
        f"{'rank':>5} {'fp8 weights':>12} {'f32 scales':>11} {'other':>11} {'FP8 total':>11} "
        f"{'BF16 total':>11} {'FP8/BF16':>9}"
    ]
    total_fp8 = total_bf16 = 0
    for r in ranks:
        k = kind_bytes(body, r)
        fp8, scale, other = k.get("fp8", 0), k.get("scale", 0), k.get("other", 0)
        as_fp8, as_bf16 = fp8 + scale + other, 2 * fp8 + other
        total_fp8, total_bf16 = total_fp8 + as_fp8, total_bf16 + as_bf16
        lines.append(
            f"{r:>5} {human_bytes(fp8):>12} {human_bytes(scale):>11} {human_bytes(other):>11} "
            f"{human_bytes(as_fp8):>11} {human_bytes(as_bf16):>11} {as_fp8 / max(as_bf16, 1):>9.3f}"
        )
    lines.append(
        f"  all ranks: {human_bytes(total_fp8)} in FP8 vs {human_bytes(total_bf16)} in BF16 "
        f"({total_fp8 / max(total_bf16, 1):.3f}x)"
    )
    return lines


def _fill(text: str, values) -> str:
    parts = text.split("{}")
    return (
        "".join(p + (str(v) if i < len(values) else "") for i, (p, v) in enumerate(zip(parts, list(values) + [""])))
        .replace("{{", "{")
        .replace("}}", "}")
    )


def op_histogram(body: PlanBody) -> Counter:
    hist: Counter = Counter()
    for g in body.groups:
        n = trie_count(g.index)
        kind = g.skeleton[3][1][0]
        if kind == "S":
            hist["view (folded box)"] += n
        elif kind == "F":
            hist["full (constant fill)"] += n
        else:
            ops: set[str] = set()
            skeleton_ops(g.skeleton, ops)
            for op in ops:
                hist[op] += n
    for writes in body.ordered.values():
        for w in writes:
            ops = ir.literal_ops(w.src.leaf)
            for op in ops or ["view (folded box)" if ir.is_pure_view(w) else "full (constant fill)"]:
                hist[op] += 1
    return hist


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


class InspectArgumentError(ShardplanError):
    """An inspect argument out of range (a negative --max-lines)."""


def inspect_plan(path: str, rank: int | None = None, max_lines: int = 200) -> str:
    if type(max_lines) is not int or max_lines < 0:
        raise InspectArgumentError(
            f"--max-lines must be a non-negative integer (0 prints every line), got {max_lines!r}"
        )
    plan = PlanFile.read(path)
    if rank is not None:
        plan.check_rank(rank)
    h, body = plan.header, plan.body
    lines = [
        f"plan {path}",
        f"  model {h.model} ({h.architecture}), config sha256 {h.config_sha256[:16]}..., dtype {h.dtype}",
        f"  layout {h.layout.tag()}, ranks {len(h.ranks)}, recorded with "
        f"{h.engine.describe() if h.engine is not None else 'vLLM ' + h.vllm_version}, "
        f"shardplan {h.shardplan_version}, format {h.format_version}",
        f"  {len(body.sources)} checkpoint tensors, {len(body.params)} params, {len(body.groups)} templates, "
        f"{body.num_writes()} writes over all ranks",
    ]
    if h.eplb is not None:
        e = h.eplb
        num_slot_names = (
            len(e.moe_layers)
            * e.num_physical_experts
            * len(
                {n.split(".experts.slot.0.")[1] for n in body.sources if ".layers." in n and ".experts.slot.0." in n}
                or {""}
            )
        )
        lines[-1] = lines[-1].replace(
            f"{len(body.sources)} checkpoint tensors",
            f"{len(body.sources) - num_slot_names} checkpoint tensors (+{num_slot_names} expert-slot names)",
        )
        lines.append(
            f"  EPLB: {e.num_logical_experts} experts + {e.num_redundant_experts} redundant = "
            f"{e.num_physical_experts} slots per MoE layer, {e.slots_per_rank} per rank on {e.num_ep_ranks} "
            f"EP ranks, {len(e.moe_layers)} MoE layers; expert writes name their slot (`experts.slot.<p>`), "
            f"bound to the engine's placement at every sync (docs/eplb.md)"
        )
    # slot names (EPLB) are not checkpoint tensors: the full broadcast is the real checkpoint's
    full_bytes = sum(m.numel * itemsize(m.dtype) for m in body.sources.values() if slot_of(m.name) is None)
    per_rank = {r: group_bytes(body, r) for r in body.ranks}
    totals = {r: sum(v.values()) for r, v in per_rank.items()}
    lines.append("")
    lines.append(f"{'rank':>5} {'bytes needed':>14} {'full broadcast':>15} {'redundancy':>11}")
    for r in body.ranks:
        lines.append(
            f"{r:>5} {human_bytes(totals[r]):>14} {human_bytes(full_bytes):>15} "
            f"{full_bytes / max(totals[r], 1):>10.1f}x"
        )
    total_needed = sum(totals.values())
    lines.append(
        f"  all ranks: {human_bytes(total_needed)} needed vs {human_bytes(full_bytes * len(body.ranks))} broadcast: "
        f"{full_bytes * len(body.ranks) / max(total_needed, 1):.1f}x redundancy"
    )
    if h.quantizer:
        lines.append("")
        lines.append(
            f"FP8 plan (quantizer {h.quantizer}): bytes per rank, and the same layout in BF16 (fp8 weights "
            f"at 2 bytes/element, no scales):"
        )
        lines.extend(fp8_vs_bf16(body, body.ranks))
    show = rank if rank is not None else body.ranks[0]
    lines.append("")
    lines.append(f"bytes per weight group, rank {show}:")
    for group, n in sorted(per_rank[show].items(), key=lambda kv: group_order(kv[0])):
        lines.append(f"  {group:<12} {human_bytes(n):>12}")
    lines.append("")
    lines.append("op histogram (writes, all ranks):")
    for op, n in op_histogram(body).most_common():
        lines.append(f"  {op:<28} {n:>10}")
    fallbacks = [(r, f) for r, fs in sorted(body.fallbacks.items()) for f in fs]
    lines.append("")
    lines.append(f"fallbacks: {len(fallbacks)}" + ("" if fallbacks else " (every needed tensor is replayed exactly)"))
    for r, f in fallbacks[:50]:
        lines.append(f"  rank {r}: {f.source}: {f.op} in {f.loader or '?'}: {f.reason}")
    if rank is not None:
        rp = plan.rank(rank)
        text = rp.format(body.sources).splitlines()
        lines.append("")
        lines.append(
            f"IR of rank {rank} ({len(rp.writes)} writes, {len(plan.not_needed(rank))} checkpoint tensors not needed):"
        )
        lines.extend(text if max_lines == 0 else text[:max_lines])
        if max_lines and len(text) > max_lines:
            lines.append(f"... {len(text) - max_lines} more lines (--max-lines 0 prints all)")
    return "\n".join(lines)
