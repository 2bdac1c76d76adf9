"""Rewrite computed writes that only repeat elements into pure-view writes (a compile-time pass).

vLLM's block-FP8 loader refines an expert's scale grid when a rank's partition is not whole blocks (Qwen3-30B-A3B-FP8
at TP4: 192 rows per rank of 128-row blocks): it upsamples the checkpoint scale with `repeat_interleave` over rows,
then columns, and narrows the result to the rank's rows. Recorded exactly, that is one `Call` chain per expert and
projection (18,432 per rank), each built as Python objects at instantiation and run as tiny ops at every sync.

`repeat_interleave(x, r, dim=d)` only repeats: output index i along d reads x[i // r]. Over a view of a checkpoint
tensor, any box of the (nested) result is therefore a union of plain strided views of that tensor: writing a logical
dim as mixed-radix digits, each digit (n, stride) addresses the source affinely, and repeating appends the digit
(r, stride 0). A box of such a dim splits into at most 2k - 1 pieces (k digits: a partial head block, whole blocks, a
partial tail, recursively), each one `as_strided` view (stride 0 where an element repeats). The pieces partition the
original destination, so they write exactly the original elements, with the original values, and never each other's.

`compile_writes` is the one entry both compile paths use (compile_plans and plan/compile/extend.py's flat_rank): overlap
is decided on the writes as recorded (the pieces of one write interleave in memory, so their extents may intersect,
although their elements never do), and only writes of non-overlapping params are rewritten. A write the pass cannot
prove equal (other ops, non-box regions, a broadcasting copy, too many pieces) is kept as recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from shardplan.plan import ir
from shardplan.plan.overlap import overlapping_params

REPEAT_OP = "Tensor.repeat_interleave"
MAX_PIECES = 16  # per write; past this the computed write is kept (a pure view per element would be no gain)

Digits = tuple[tuple[int, int], ...]  # (size, source stride) per mixed-radix digit of one dim, outer first


@dataclass(frozen=True)
class _Piece:
    """One strided view of the source inside a logical tensor: where it starts (per dim), its digits, its offset."""

    pos: tuple[int, ...]
    digits: tuple[Digits, ...]
    offset: int


@dataclass(frozen=True)
class _Tiled:
    """A logical tensor of `shape` (the value of a view) tiled by pieces that all read one checkpoint tensor."""

    source: str
    shape: tuple[int, ...]
    pieces: tuple[_Piece, ...]


def compile_writes(writes: Sequence[ir.Write]) -> tuple[list[ir.Write], list[ir.Write]]:
    """(free, ordered) of one rank's recorded writes, empty ones dropped: writes into params whose destinations
    overlap keep recording order (ordered, as recorded); the others are free, each rewritten by `simplify_write`."""
    writes = [w for w in writes if w.dst.numel > 0]
    overlapping = overlapping_params(writes)
    free: list[ir.Write] = []
    ordered: list[ir.Write] = []
    for w in writes:
        if w.param in overlapping:
            ordered.append(w)
        else:
            free.extend(simplify_write(w))
    return coalesce(free), ordered


def coalesce(writes: Sequence[ir.Write]) -> list[ir.Write]:
    """Runs of pure-view writes of one param from one source, alike but for offsets that advance by one constant
    step on each side, as one write with an extra outer dim (exact duplicates dropped first).

    vLLM's loader for a checkpoint that stores experts stacked (Qwen3.5's `experts.gate_up_proj [E, 2I, H]`) copies
    one expert at a time: hundreds of writes per layer that differ only in the expert index, which neither the
    layer nor the rank holes of a template can express. Only for params no two writes overlap in (the caller's
    `free` writes): element (i, rest) of the merged write is element `rest` of the i-th write, so it writes exactly
    their elements with their values."""
    writes = list(dict.fromkeys(writes))
    runs: dict[tuple, list[ir.Write]] = {}
    out: list[ir.Write] = []
    for w in writes:
        if isinstance(w.src.leaf, ir.Source) and w.src.region.sizes == w.dst.sizes:
            key = (w.param, w.src.leaf, w.dst.sizes, w.dst.strides, w.src.region.strides)
            runs.setdefault(key, []).append(w)
        else:
            out.append(w)
    for group in runs.values():
        group.sort(key=lambda w: w.dst.offset)
        start = 0
        while start < len(group):
            end = start + 1
            if end < len(group):
                step = (
                    group[end].dst.offset - group[start].dst.offset,
                    group[end].src.region.offset - group[start].src.region.offset,
                )
                while (
                    end < len(group)
                    and step[0] > 0
                    and group[end].dst.offset - group[end - 1].dst.offset == step[0]
                    and group[end].src.region.offset - group[end - 1].src.region.offset == step[1]
                ):
                    end += 1
            out.append(_stacked(group[start:end]))
            start = max(end, start + 1)
    return out


def _stacked(run: list[ir.Write]) -> ir.Write:
    first = run[0]
    if len(run) == 1:
        return first
    dst_step = run[1].dst.offset - first.dst.offset
    src_step = run[1].src.region.offset - first.src.region.offset
    dims = [(len(run), dst_step, src_step), *zip(first.dst.sizes, first.dst.strides, first.src.region.strides)]
    sizes, dst_strides, src_strides = _merge(dims)
    return ir.Write(
        first.param,
        ir.Region(first.dst.offset, sizes, dst_strides),
        ir.View(first.src.leaf, ir.Region(first.src.region.offset, sizes, src_strides)),
    )


def simplify_write(w: ir.Write) -> list[ir.Write]:
    """Pure-view writes equal to `w` (they partition its destination), or [w] when it is a pure view already or the
    pass does not apply."""
    if not isinstance(w.src.leaf, ir.Call) or w.src.region.sizes != w.dst.sizes:
        return [w]
    tiled = _lower(w.src)
    if tiled is None or len(tiled.pieces) > MAX_PIECES:
        return [w]
    out = []
    for piece in tiled.pieces:
        dst_offset = w.dst.offset + sum(p * s for p, s in zip(piece.pos, w.dst.strides))
        dims = []  # (size, dst stride, src stride)
        for digits, dst_stride in zip(piece.digits, w.dst.strides):
            weight = math.prod(n for n, _ in digits)
            for n, src_stride in digits:
                weight //= n
                dims.append((n, dst_stride * weight, src_stride))
        sizes, dst_strides, src_strides = _merge(dims)
        out.append(
            ir.Write(
                w.param,
                ir.Region(dst_offset, sizes, dst_strides),
                ir.View(ir.Source(tiled.source), ir.Region(piece.offset, sizes, src_strides)),
            )
        )
    return out


def _merge(dims: list[tuple[int, int, int]]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Size-1 dims dropped, neighbours merged where both sides step as one dim; a single size-1 dim if none is left."""
    out: list[list[int]] = []
    for n, dst, src in dims:
        if n == 1:
            continue
        if out and out[-1][1] == n * dst and out[-1][2] == n * src:
            out[-1] = [out[-1][0] * n, dst, src]
        else:
            out.append([n, dst, src])
    if not out:
        return (1,), (1,), (1,)
    return tuple(d[0] for d in out), tuple(d[1] for d in out), tuple(d[2] for d in out)


# ---- lowering: a view tree of repeat_interleave calls over one checkpoint tensor -> pieces ------------------------
def _lower(view: ir.View) -> _Tiled | None:
    leaf = view.leaf
    if isinstance(leaf, ir.Source):
        r = view.region
        if min(r.sizes, default=1) < 1 or min(r.strides, default=0) < 0 or r.offset < 0:
            return None
        return _Tiled(
            leaf.name,
            tuple(r.sizes),
            (_Piece((0,) * len(r.sizes), tuple(((s, st),) for s, st in zip(r.sizes, r.strides)), r.offset),),
        )
    if not isinstance(leaf, ir.Call) or leaf.op != REPEAT_OP or leaf.out is not None or len(leaf.inputs) != 1:
        return None
    repeat = _repeat_args(leaf)
    if repeat is None:
        return None
    inner = _lower(leaf.inputs[0])
    if inner is None:
        return None
    repeats, dim = repeat
    ndim = len(inner.shape)
    if not -ndim <= dim < ndim:
        return None
    dim %= ndim
    # the call's value: a fresh contiguous tensor, dim `dim` r times longer (torch returns one for any input:
    # tests/unit/test_simplify.py checks it), so the view's region addresses it as the recorder saw it
    shape = tuple(s * repeats if d == dim else s for d, s in enumerate(inner.shape))
    pieces = tuple(
        _Piece(
            tuple(p * repeats if d == dim else p for d, p in enumerate(piece.pos)),
            tuple(_normal(digits + ((repeats, 0),)) if d == dim else digits for d, digits in enumerate(piece.digits)),
            piece.offset,
        )
        for piece in inner.pieces
    )
    return _select(_Tiled(inner.source, shape, pieces), view.region)


def _repeat_args(call: ir.Call) -> tuple[int, int] | None:
    """(repeats, dim) of `x.repeat_interleave(repeats, dim)` with int repeats >= 1 and an int dim, else None (a
    tensor of repeats, dim None (flattens), output_size or anything else: not handled)."""
    args, kwargs = call.args, dict(call.kwargs)
    if not args or args[0] != ir.Arg(0) or len(args) > 3 or set(kwargs) - {"repeats", "dim"}:
        return None
    values = {
        "repeats": args[1] if len(args) > 1 else kwargs.get("repeats"),
        "dim": args[2] if len(args) > 2 else kwargs.get("dim"),
    }
    if (len(args) > 1 and "repeats" in kwargs) or (len(args) > 2 and "dim" in kwargs):
        return None
    repeats, dim = values["repeats"], values["dim"]
    if type(repeats) is not int or type(dim) is not int or repeats < 1:
        return None
    return repeats, dim


def _normal(digits: Digits) -> Digits:
    """Size-1 digits dropped and neighbours merged where the outer one steps over the inner one whole."""
    out: list[tuple[int, int]] = []
    for n, stride in digits:
        if n == 1:
            continue
        if out and out[-1][1] == n * stride:
            out[-1] = (out[-1][0] * n, stride)
        else:
            out.append((n, stride))
    return tuple(out)


def _select(tiled: _Tiled, region: ir.Region) -> _Tiled | None:
    """The tiled value of `region` of a contiguous tensor of `tiled.shape`, when the region is a box of it (each dim
    of size > 1 walks one dim of the tensor, in order, with step 1); None otherwise."""
    box = _as_box(region, tiled.shape)
    if box is None:
        return None
    starts, dim_of = box
    lengths = [1] * len(tiled.shape)
    for k, d in enumerate(dim_of):
        if d is not None:
            lengths[d] = region.sizes[k]
    pieces = []
    for piece in tiled.pieces:
        per_dim = []  # per tensor dim: [(position in the box, offset, digits)]
        for d, (pos, digits) in enumerate(zip(piece.pos, piece.digits)):
            length = math.prod(n for n, _ in digits)
            lo, hi = max(pos, starts[d]) - pos, min(pos + length, starts[d] + lengths[d]) - pos
            if lo >= hi:
                break
            per_dim.append([(pos + local - starts[d], offset, sub) for local, offset, sub in _split(digits, lo, hi)])
        else:
            combos = [((), (), piece.offset)]
            for d, parts in enumerate(per_dim):
                combos = [(p + (q,), g + (sub,), off + o) for p, g, off in combos for q, o, sub in parts]
                if len(combos) > MAX_PIECES:
                    return None
            for pos, digits, offset in combos:
                pieces.append(
                    _Piece(
                        tuple(pos[d] if d is not None else 0 for d in dim_of),
                        tuple(digits[d] if d is not None else () for d in dim_of),
                        offset,
                    )
                )
            if len(pieces) > MAX_PIECES:
                return None
    return _Tiled(tiled.source, tuple(region.sizes), tuple(pieces))


def _split(digits: Digits, lo: int, hi: int) -> list[tuple[int, int, Digits]]:
    """[lo, hi) of a dim with these digits as (local start, source offset, digits) pieces: at most 2k - 1."""
    if not digits:
        return [(0, 0, ())]
    (_, stride), rest = digits[0], digits[1:]
    inner = math.prod(m for m, _ in rest)
    q_lo, r_lo = divmod(lo, inner)
    q_hi, r_hi = divmod(hi, inner)
    if q_lo == q_hi:  # inside one block of the outer digit
        return [(q_lo * inner + s, q_lo * stride + o, d) for s, o, d in _split(rest, r_lo, r_hi)]
    out = []
    first = q_lo
    if r_lo:
        out += [(q_lo * inner + s, q_lo * stride + o, d) for s, o, d in _split(rest, r_lo, inner)]
        first += 1
    if q_hi > first:
        out.append((first * inner, first * stride, _normal(((q_hi - first, stride),) + rest)))
    if r_hi:
        out += [(q_hi * inner + s, q_hi * stride + o, d) for s, o, d in _split(rest, 0, r_hi)]
    return out


def _as_box(region: ir.Region, shape: tuple[int, ...]) -> tuple[list[int], list[int | None]] | None:
    """(start per tensor dim, tensor dim of each region dim or None for a size-1 one) when `region` of a contiguous
    tensor of `shape` is a box of it; None otherwise."""
    strides = ir.contiguous_strides(shape)
    numel = math.prod(shape)
    if not 0 <= region.offset < numel or min(region.sizes, default=1) < 1:
        return None
    starts = [(region.offset // st) % n for st, n in zip(strides, shape)]
    dim_of: list[int | None] = []
    last = -1
    for size, stride in zip(region.sizes, region.strides):
        if size == 1:
            dim_of.append(None)
            continue
        d = next((d for d in range(last + 1, len(shape)) if shape[d] > 1 and strides[d] == stride), None)
        if d is None or starts[d] + size > shape[d]:
            return None
        dim_of.append(d)
        last = d
    return starts, dim_of
