"""Sharded trainers: re-plan consumer writes against the boxes each trainer rank holds.

A trainer rank holds, per checkpoint tensor, at most one box of the full HF tensor (Megatron/FSDP TP along a dim,
EP = whole expert tensors on some ranks, PP = whole layers on some ranks, DP = replicas), stored as its own contiguous
local tensor under the same name. `plan_shards` intersects every pure-view write's source region with those boxes,
splits the write into pieces whose source is expressed against the holding rank's LOCAL tensor and whose destination is
the matching sub-region of the param, and assigns each piece to one holder (least bytes so far, largest pieces first,
so replicas share the work). The result is, per (trainer rank, consumer rank), an ordinary `ir.RankPlan` that
`Replayer` and `Applier` take unchanged.

Block-FP8 plans (`quantizer=`, the plan header's): trainers hold high-precision `X.weight` boxes and no scales; each
quantizes its own boxes (runtime.quantize.QuantizingReplayer over its sub-plans), so `X.weight_scale_inv` is held, in
block units, by the ranks whose weight boxes make it (`scale_shards`). A box that cuts blocks (FSDP2's `Shard(0)` at
most sizes) is quantized from a staging tensor over the box widened to whole blocks (`CutBox`): zeros outside the
box, except one element per cut block that holds the block's amax over every holder, exchanged per sync
(`CutGroup`: partials, combine, stage), so each holder computes the same scale the whole block has.

Refused at planning time, with a named error naming the tensor and the box: a needed byte held by no trainer rank;
a non-view write (Call/Full/Update) whose inputs no single rank holds whole; overlapping writes (last write wins)
that no single rank can serve together (their order must stay within one buffer); a trainer holding scales of a
block-FP8 plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from shardplan.errors import MissingTensorError, ShardplanError
from shardplan.plan import ir
from shardplan.plan.columns import columns_of
from shardplan.plan.interp import to_dtype
from shardplan.plan.names import group_layer, group_of, is_scale, scale_name, weight_of_scale
from shardplan.plan.overlap import overlap_clusters, overlapping_writes, param_shapes
from shardplan.runtime.pack import PackLayout
from shardplan.runtime.quantize import NonFiniteBlockError, block_amax, parse_quantizer
from shardplan.runtime.tensors import TensorShapeError, broadcast_region

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim of the full tensor


class ShardError(ShardplanError):
    """Base class for sharded-trainer planning errors."""


class ShardLayoutError(ShardError):
    """The trainer layout itself is invalid (box out of bounds, two boxes of one tensor on one rank)."""


class UncoveredSourceError(ShardError):
    """Some byte a consumer needs is held by no trainer rank."""


class UnassignableWriteError(ShardError):
    """A non-view write needs whole input tensors that no single trainer rank holds."""


class ShardOverlapError(ShardError):
    """Overlapping destination writes (last write wins) can't all be served by one trainer rank."""


class AmaxExchangeError(ShardError):
    """A trainer box cuts blocks of a block-FP8 weight, and the blocks' amaxes from the other holders are missing,
    inconsistent or not exact in the staging dtype: packing would give the block a scale of its own."""


@dataclass(frozen=True, slots=True)
class TrainerShard:
    """Trainer rank `rank` holds `full_tensor[box]` of checkpoint tensor `name`, as a contiguous local tensor."""

    name: str
    rank: int
    box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)


@dataclass(frozen=True, slots=True)
class CutBox:
    """A trainer rank's box `held` of a block-FP8 weight whose blocks some holder's box cuts, and `padded`: held
    widened to whole blocks (the rank's local tensor in the sub-plans). Where they differ the rank quantizes from a
    staging tensor over `padded`; where they do not, it only contributes its amaxes to the holders that do."""

    held: Box
    padded: Box
    block: tuple[int, int]


# ---- common layouts -----------------------------------------------------------------------------------------------
def full_box(shape: Iterable[int]) -> Box:
    return tuple((0, s) for s in shape)


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """torch.tensor_split bounds: the first size % parts parts get one extra element."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def tp_shards(
    sources: Mapping[str, ir.TensorMeta],
    tp: int,
    split_dim: Callable[[str], int | None],
    ranks: Sequence[int] | None = None,
    block: Callable[[str], int] | None = None,
) -> list[TrainerShard]:
    """Tensor parallel: tensor `name` split into `tp` boxes along `split_dim(name)` (None: replicated on all).
    `block(name)`: split in units of that many elements of the dim (the last may be short; a rank may get none), e.g.
    whole 128-blocks of a block-FP8 plan's quantized weights (`scale_shards`); default 1."""
    ranks = list(range(tp)) if ranks is None else list(ranks)
    shards = []
    for name, meta in sources.items():
        dim = split_dim(name)
        unit = 1 if block is None else block(name)
        for i, rank in enumerate(ranks):
            box = list(full_box(meta.shape))
            if dim is not None:
                lo, hi = split_range(-(-meta.shape[dim] // unit), tp, i)
                box[dim] = (min(lo * unit, meta.shape[dim]), min(hi * unit, meta.shape[dim]))
            shards.append(TrainerShard(name, rank, tuple(box)))
    return shards


def ep_shards(
    sources: Mapping[str, ir.TensorMeta], ep: int, expert_of: Callable[[str], int | None], num_experts: int
) -> list[TrainerShard]:
    """Expert parallel: expert e's tensors (whole) on rank e * ep // num_experts; non-expert tensors
    (`expert_of` None) replicated on every rank."""
    shards = []
    for name, meta in sources.items():
        expert = expert_of(name)
        ranks = range(ep) if expert is None else [expert * ep // num_experts]
        shards += [TrainerShard(name, r, full_box(meta.shape)) for r in ranks]
    return shards


def pp_shards(sources: Mapping[str, ir.TensorMeta], pp: int, stage_of: Callable[[str], int]) -> list[TrainerShard]:
    """Pipeline parallel: every tensor whole on the rank of its stage."""
    return [TrainerShard(name, stage_of(name), full_box(meta.shape)) for name, meta in sources.items()]


def compose(outer: Sequence[TrainerShard], inner: Sequence[TrainerShard], inner_size: int) -> list[TrainerShard]:
    """Two layouts on a 2-D mesh: rank = outer_rank * inner_size + inner_rank, box = intersection (e.g. PP x TP,
    EP x TP, DP x TP with a replicated outer layout)."""
    by_name: dict[str, list[TrainerShard]] = {}
    for s in inner:
        by_name.setdefault(s.name, []).append(s)
    shards = []
    for o in outer:
        for i in by_name.get(o.name, ()):
            box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(o.box, i.box))
            if all(lo < hi for lo, hi in box):
                shards.append(TrainerShard(o.name, o.rank * inner_size + i.rank, box))
    return shards


def replicate(shards: Sequence[TrainerShard], dp: int, world: int) -> list[TrainerShard]:
    """`dp` data-parallel replicas of a layout over `world` ranks each: replica k's ranks are offset by k * world."""
    return [TrainerShard(s.name, s.rank + k * world, s.box) for k in range(dp) for s in shards]


def layer_stage(num_layers: int, pp: int) -> Callable[[str], int]:
    """Contiguous blocks of layers per stage; embeddings on the first stage, everything else on the last."""

    def stage_of(name: str) -> int:
        layer = group_layer(group_of(name))
        if layer >= 0:
            return layer * pp // num_layers
        return 0 if group_of(name) == "embed" else pp - 1

    return stage_of


# ---- the planner ------------------------------------------------------------------------------------------------
@dataclass
class ShardedPlan:
    """Per (trainer rank, consumer rank): the writes that trainer rank packs for that consumer, against its local
    tensors (`sources[trainer_rank]`). Consumers apply every trainer rank's buffer; the pieces are disjoint, except
    overlapping writes, which always come from one trainer rank in plan order."""

    plans: dict[tuple[int, int], ir.RankPlan]
    sources: dict[int, dict[str, ir.TensorMeta]]
    bytes_by_trainer: dict[int, int]
    fallbacks: dict[int, tuple[ir.Fallback, ...]] = field(default_factory=dict)
    quantizer: str = ""  # a block-FP8 plan's: each trainer quantizes its own weight boxes (sources: fp8 + scales)
    cut: dict[int, dict[str, CutBox]] = field(default_factory=dict)  # trainer rank -> holders of cut blocks (cut_boxes)

    @property
    def trainer_ranks(self) -> list[int]:
        return sorted({t for t, _ in self.plans})

    def for_trainer(self, rank: int) -> list[ir.RankPlan]:
        """The consumer plans trainer `rank` packs (one buffer for all: `Replayer(plans, sources[rank])`)."""
        return [p for (t, _), p in sorted(self.plans.items()) if t == rank]

    def for_consumer(self, rank: int) -> dict[int, ir.RankPlan]:
        """trainer rank -> the sub-plan consumer `rank` receives from it."""
        return {t: p for (t, c), p in sorted(self.plans.items()) if c == rank}

    def layout(self, trainer_rank: int, alignment: int = 256) -> PackLayout:
        """The buffer layout of one trainer rank (all its consumers), computable on either side from this plan."""
        return PackLayout.from_plans(self.for_trainer(trainer_rank), alignment)


def local_tensors(
    shards: Sequence[TrainerShard], rank: int, full: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What trainer `rank` holds, cut from full tensors (tests and benchmarks; a real trainer already has these)."""
    out = {}
    for s in shards:
        if s.rank == rank and s.name in full:
            out[s.name] = full[s.name][tuple(slice(a, b) for a, b in s.box)].contiguous()
    return out


@dataclass
class _Piece:
    """Part of one consumer write servable from one cell of the trainer boxes."""

    consumer: int
    write: int
    sub: int  # order within the write
    holders: tuple[int, ...]
    nbytes: int
    make: Callable[[int], ir.Write]  # trainer rank -> the sub-write against that rank's local tensor
    rank: int | None = None


def scale_shards(
    shards: Sequence[TrainerShard], sources: Mapping[str, ir.TensorMeta], quantizer: str
) -> list[TrainerShard]:
    """The scale boxes of a quantizing sync: each holder of a quantized weight's box makes the scales of the blocks
    its box touches (`X.weight_scale_inv`, in block units; a block cut between holders gets the same scale from each,
    `cut_boxes`)."""
    _, block = parse_quantizer(quantizer)
    out = []
    for s in shards:
        meta, weight = sources.get(s.name), sources.get(weight_of_scale(s.name))
        if is_scale(s.name) and weight is not None and weight.dtype == "float8_e4m3fn":
            raise ShardLayoutError(
                f"trainer rank {s.rank} holds {s.name!r}: in a sync of a block-FP8 plan ({quantizer}) trainers "
                f"hold the weights in high precision and no scales (each rank makes the scales of its boxes)"
            )
        if meta is None or meta.dtype != "float8_e4m3fn" or scale_name(s.name) not in sources:
            continue
        if any(a == b for a, b in s.box):
            continue  # an uneven split left this rank nothing of the tensor
        box = tuple((a // bs, -(-b // bs)) for (a, b), bs in zip(s.box, block))
        out.append(TrainerShard(scale_name(s.name), s.rank, box))
    return out


def cut_boxes(
    shards: Sequence[TrainerShard], sources: Mapping[str, ir.TensorMeta], quantizer: str
) -> dict[int, dict[str, CutBox]]:
    """Trainer rank -> quantized weight -> its box widened to whole blocks, for every holder of a weight that some
    holder's box cuts (a box that does not start on a block boundary, or ends off one before the tensor's edge):
    those holders exchange per-block amaxes each sync, even the ones holding their blocks whole."""
    _, block = parse_quantizer(quantizer)
    held: dict[str, list[TrainerShard]] = {}
    for s in shards:
        meta = sources.get(s.name)
        if meta is None or meta.dtype != "float8_e4m3fn" or scale_name(s.name) not in sources:
            continue
        if not any(a == b for a, b in s.box):
            held.setdefault(s.name, []).append(s)
    out: dict[int, dict[str, CutBox]] = {}
    for name, boxes in sorted(held.items()):
        shape = sources[name].shape
        padded = {
            s.rank: tuple((a - a % bs, min(-(-b // bs) * bs, n)) for (a, b), bs, n in zip(s.box, block, shape))
            for s in boxes
        }
        if len(shape) != 2 or all(padded[s.rank] == s.box for s in boxes):
            continue
        for s in boxes:
            out.setdefault(s.rank, {})[name] = CutBox(s.box, padded[s.rank], block)
    return out


def plan_shards(
    plans: ir.RankPlan | Sequence[ir.RankPlan],
    sources: Mapping[str, ir.TensorMeta],
    shards: Sequence[TrainerShard],
    *,
    quantizer: str = "",
) -> ShardedPlan:
    """Split consumer plans (written against full HF tensors) into per-(trainer rank, consumer rank) plans against
    trainer-local shards. Deterministic; balances bytes across replicas; refuses impossible layouts up front.
    `quantizer`: a block-FP8 plan's (its header's), when the trainers hold high-precision weights (`scale_shards`)."""
    plans = (plans,) if isinstance(plans, ir.RankPlan) else tuple(plans)
    cut: dict[int, dict[str, CutBox]] = {}
    if quantizer:
        cut = cut_boxes(shards, sources, quantizer)
        shards = [*shards, *scale_shards(shards, sources, quantizer)]
    by_name = _index_shards(shards, sources)
    origins = {n: dict(boxes) for n, boxes in by_name.items()}  # where each rank's local tensor starts
    for rank, boxes in cut.items():
        for name, c in boxes.items():
            origins[name][rank] = c.padded
    pieces: list[_Piece] = []
    pinned: list[list[_Piece]] = []
    for plan in plans:
        dtypes = {p.name: to_dtype(p.dtype).itemsize for p in plan.params}
        plan_pieces = []
        for index, w in enumerate(plan.writes):
            plan_pieces.append(_write_pieces(plan.rank, index, w, dtypes[w.param], sources, by_name, origins))
        for cluster in _sharing_clusters(plan):
            pinned.append([p for i in cluster for p in plan_pieces[i]])
        pieces += [p for ps in plan_pieces for p in ps]
    load = {r: 0 for r in sorted({s.rank for s in shards})}
    for cluster in sorted(pinned, key=lambda c: -sum(p.nbytes for p in c)):
        _assign_cluster(cluster, load, plans)
    for piece in sorted((p for p in pieces if p.rank is None), key=lambda p: (-p.nbytes, p.consumer, p.write, p.sub)):
        piece.rank = min(piece.holders, key=lambda r: (load[r], r))
        load[piece.rank] += piece.nbytes
    sharded = _collect(plans, pieces, origins, sources, load)
    sharded.quantizer, sharded.cut = quantizer, cut
    return sharded


def _sharing_clusters(plan: ir.RankPlan) -> list[list[int]]:
    """Clusters of the plan's writes that may share a param element (last write wins: one trainer rank keeps their
    order). Extents alone over-approximate: an upsampled block-FP8 scale's views interleave (plan/overlap.py), and
    pinning them together would refuse every trainer layout that splits that scale; so extents, then boxes."""
    if len(plan.writes) < 2:
        return []
    cols = columns_of(plan)
    metas = {m.name: m for m in plan.params}
    may = np.flatnonzero(
        overlapping_writes(
            cols.param,
            cols.dst_offset,
            cols.dst_sizes,
            cols.dst_strides,
            param_shapes(cols.param_names, metas)[cols.param],
        )
    )
    return [[int(may[i]) for i in c] for c in overlap_clusters([plan.writes[i] for i in may.tolist()])]


def _index_shards(shards: Sequence[TrainerShard], sources: Mapping[str, ir.TensorMeta]) -> dict[str, dict[int, Box]]:
    by_name: dict[str, dict[int, Box]] = {}
    for s in shards:
        meta = sources.get(s.name)
        if meta is None:
            continue  # the trainer holds tensors no consumer plan reads
        if len(s.box) != len(meta.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(s.box, meta.shape)):
            raise ShardLayoutError(
                f"trainer rank {s.rank}: box {list(s.box)} of {s.name!r} is outside its shape {list(meta.shape)}"
            )
        if any(a == b for a, b in s.box):
            continue  # an uneven split left this rank nothing of the tensor
        if s.rank in by_name.setdefault(s.name, {}):
            raise ShardLayoutError(
                f"trainer rank {s.rank} holds two boxes of {s.name!r}: "
                f"{list(by_name[s.name][s.rank])} and {list(s.box)} (one local tensor per name and "
                f"rank)"
            )
        by_name[s.name][s.rank] = s.box
    return by_name


# ---- geometry: a strided region as a box of its tensor -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Dim:
    size: int
    dst_stride: int
    src_dim: int | None  # full-tensor dim it walks, None for a broadcast (stride 0) dim
    step: int


def _box_form(region: ir.Region, dst: ir.Region, shape: tuple[int, ...]) -> tuple[list[int], list[_Dim]] | None:
    """Express `region` (already broadcast to dst sizes) of a contiguous `shape` tensor as start coordinates plus
    index dims each walking one tensor dim at a constant step; merged dims (a view(-1) of rows) are split back.
    None when the region is not such a box."""
    strides = ir.contiguous_strides(shape)
    if region.offset >= max(math.prod(shape), 1):
        return None
    starts, rem = [], region.offset
    for stride in strides:
        starts.append(rem // stride)
        rem %= stride
    pending = [(n, s, t) for n, s, t in zip(region.sizes, region.strides, dst.strides) if n != 1]
    dims: list[_Dim] = []
    while len(dims) < len(pending):  # dims stay in region order, so row-major merges survive for the copy kernels
        size, src_stride, dst_stride = pending[len(dims)]
        if src_stride == 0:
            dims.append(_Dim(size, dst_stride, None, 0))
            continue
        for d, stride in enumerate(strides):
            if shape[d] == 1 or src_stride % stride:
                continue
            step = src_stride // stride
            if starts[d] + step * (size - 1) < shape[d]:
                dims.append(_Dim(size, dst_stride, d, step))
                break
            if step == 1 and starts[d] == 0 and size % shape[d] == 0 and d > 0:
                # a merged dim (a view(-1) of whole rows): split into (size / shape[d]) x shape[d], map each half
                pending[len(dims) : len(dims) + 1] = [
                    (size // shape[d], src_stride * shape[d], dst_stride * shape[d]),
                    (shape[d], src_stride, dst_stride),
                ]
                break
            return None
        else:
            return None
    used = [d.src_dim for d in dims if d.src_dim is not None]
    if len(used) != len(set(used)):
        return None
    return starts, dims


def _write_pieces(
    consumer: int,
    index: int,
    w: ir.Write,
    itemsize: int,
    sources: Mapping[str, ir.TensorMeta],
    by_name: dict[str, dict[int, Box]],
    origins: dict[str, dict[int, Box]],
) -> list[_Piece]:
    if not ir.is_pure_view(w):
        return [_whole_piece(consumer, index, w, itemsize, sources, by_name)]
    name = w.src.leaf.name
    meta = sources[name]
    region = broadcast_region(w.src.region, w.dst.sizes)
    form = _box_form(region, w.dst, meta.shape) if region is not None and w.dst.numel else None
    holders = by_name.get(name, {})
    if form is None:
        if w.dst.numel == 0:
            return []
        whole = [r for r, b in holders.items() if b == full_box(meta.shape)]
        if not whole:
            raise UncoveredSourceError(
                f"rank {consumer} write {index} ({w.param}) reads a non-box region of "
                f"{name!r} ({ir.region_str(meta.shape, w.src.region)}): it needs a trainer "
                f"rank holding all of {meta.dtype}{list(meta.shape)}, and none does"
            )
        return [_Piece(consumer, index, 0, tuple(sorted(whole)), w.dst.numel * itemsize, lambda r, w=w: w)]
    starts, dims = form
    pieces = []
    for cell in _cells(starts, dims, meta.shape, holders.values()):
        ranges = _index_ranges(cell, starts, dims)
        if ranges is None:
            continue
        cell_holders = tuple(sorted(r for r, b in holders.items() if _contains(b, cell)))
        if not cell_holders:
            raise UncoveredSourceError(
                f"rank {consumer} write {index} ({w.param}) needs box {list(cell)} of "
                f"{name!r} ({meta.dtype}{list(meta.shape)}), which no trainer rank holds"
            )
        nbytes = math.prod(b - a for a, b in ranges) * itemsize
        pieces.append(
            _Piece(
                consumer,
                index,
                len(pieces),
                cell_holders,
                nbytes,
                lambda r, ranges=ranges: _sub_write(w, name, starts, dims, ranges, origins[name][r]),
            )
        )
    return pieces


def _cells(starts: list[int], dims: list[_Dim], shape: tuple[int, ...], boxes: Iterable[Box]) -> list[Box]:
    """The grid cells (in full-tensor coordinates) that the region touches, cut at every box edge."""
    touched = [(s, s + 1) for s in starts]
    for d in dims:
        if d.src_dim is not None:
            touched[d.src_dim] = (starts[d.src_dim], starts[d.src_dim] + d.step * (d.size - 1) + 1)
    axes = []
    for dim, (lo, hi) in enumerate(touched):
        cuts = sorted({lo, hi} | {edge for box in boxes for edge in box[dim] if lo < edge < hi})
        axes.append(list(zip(cuts, cuts[1:])))
    cells = [()]
    for axis in axes:
        cells = [c + (iv,) for c in cells for iv in axis]
    return cells


def _index_ranges(cell: Box, starts: list[int], dims: list[_Dim]) -> list[tuple[int, int]] | None:
    """Index range of each dim whose elements fall in `cell`; None if none does."""
    ranges = []
    for d in dims:
        if d.src_dim is None:
            ranges.append((0, d.size))
            continue
        lo, hi = cell[d.src_dim]
        start = starts[d.src_dim]
        a = max(0, -(-(lo - start) // d.step))
        b = min(d.size, -(-(hi - start) // d.step))
        if a >= b:
            return None
        ranges.append((a, b))
    return ranges


def _contains(box: Box, cell: Box) -> bool:
    return all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(box, cell))


def _sub_write(
    w: ir.Write, name: str, starts: list[int], dims: list[_Dim], ranges: list[tuple[int, int]], box: Box
) -> ir.Write:
    """The piece `ranges` of write w, its source re-expressed against the local tensor full[box]."""
    local_shape = tuple(b - a for a, b in box)
    local_strides = ir.contiguous_strides(local_shape)
    coords = list(starts)
    dst_offset = w.dst.offset
    for d, (a, _) in zip(dims, ranges):
        dst_offset += a * d.dst_stride
        if d.src_dim is not None:
            coords[d.src_dim] = starts[d.src_dim] + d.step * a
    src_offset = sum((c - lo) * s for c, (lo, _), s in zip(coords, box, local_strides))
    sizes = tuple(b - a for a, b in ranges)
    src_strides = tuple(0 if d.src_dim is None else d.step * local_strides[d.src_dim] for d in dims)
    dst = ir.Region(dst_offset, sizes, tuple(d.dst_stride for d in dims))
    return ir.Write(w.param, dst, ir.View(ir.Source(name), ir.Region(src_offset, sizes, src_strides)))


def _whole_piece(
    consumer: int,
    index: int,
    w: ir.Write,
    itemsize: int,
    sources: Mapping[str, ir.TensorMeta],
    by_name: dict[str, dict[int, Box]],
) -> _Piece:
    """A non-view write runs the interpreter on whole input tensors: only a rank holding all of them can serve it."""
    names: set[str] = set()
    ir.sources(w.src.leaf, names)
    candidates = None
    for name in sorted(names):
        whole = {r for r, b in by_name.get(name, {}).items() if b == full_box(sources[name].shape)}
        candidates = whole if candidates is None else candidates & whole
    if candidates is None:  # reads no checkpoint tensor (Full): any rank
        candidates = {r for boxes in by_name.values() for r in boxes}
    if not candidates:
        raise UnassignableWriteError(
            f"rank {consumer} write {index} ({w.param}) computes "
            f"{ir.literal_ops(w.src.leaf) or ['a constant']} from {sorted(names)}: no "
            f"trainer rank holds all of them whole"
        )
    return _Piece(consumer, index, 0, tuple(sorted(candidates)), w.dst.numel * itemsize, lambda r: w)


def _assign_cluster(cluster: list[_Piece], load: dict[int, int], plans) -> None:
    candidates = set.intersection(*(set(p.holders) for p in cluster)) if cluster else set()
    if cluster and not candidates:
        p = cluster[0]
        params = sorted({next(pl for pl in plans if pl.rank == p.consumer).writes[q.write].param for q in cluster})
        raise ShardOverlapError(
            f"rank {p.consumer}: writes {sorted({q.write for q in cluster})} to {params} overlap "
            f"(last write wins), so one trainer rank must serve them all, and none holds every "
            f"piece they read"
        )
    if not cluster:
        return
    rank = min(candidates, key=lambda r: (load[r], r))
    for p in cluster:
        p.rank = rank
        load[rank] += p.nbytes


def _collect(plans, pieces: list[_Piece], origins, sources, load) -> ShardedPlan:
    by_pair: dict[tuple[int, int], list[tuple[int, int, ir.Write]]] = {}
    for p in pieces:
        by_pair.setdefault((p.rank, p.consumer), []).append((p.write, p.sub, p.make(p.rank)))
    out_plans = {}
    for (trainer, consumer), items in sorted(by_pair.items()):
        plan = next(pl for pl in plans if pl.rank == consumer)
        writes = tuple(w for _, _, w in sorted(items, key=lambda x: (x[0], x[1])))  # plan order kept
        written = {w.param for w in writes}
        out_plans[(trainer, consumer)] = ir.RankPlan(
            consumer, tuple(m for m in plan.params if m.name in written), writes
        )
    local: dict[int, dict[str, ir.TensorMeta]] = {}
    for name, boxes in origins.items():
        for rank, box in boxes.items():
            local.setdefault(rank, {})[name] = ir.TensorMeta(name, tuple(b - a for a, b in box), sources[name].dtype)
    return ShardedPlan(out_plans, local, dict(load), {p.rank: p.fallbacks for p in plans if p.fallbacks})


# ---- blocks cut between trainers: the per-sync amax exchange -----------------------------------------------------
def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _block_box(c: CutBox) -> Box:
    return tuple((a // bs, -(-b // bs)) for (a, b), bs in zip(c.padded, c.block))


@dataclass
class _Geometry:
    """Weights of one CutGroup with the same held box inside the same padded extent: staged as one batch, their cut
    blocks planted at the same elements."""

    names: list[str]
    cut: CutBox
    plant: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None  # rows, cols, block rows, block cols
    _index: dict = field(default_factory=dict)  # device -> (rows, cols, block rows, block cols) on it

    def index(self, device: torch.device):
        if device not in self._index:
            self._index[device] = tuple(torch.from_numpy(a).to(device) for a in self.plant)
        return self._index[device]


class CutGroup:
    """Trainer `rank`'s weights of one source group in `cut` (ShardedPlan.cut): the partial block amaxes it publishes,
    the amaxes it combines from its peers', and its tensors staged with them planted. Batched by geometry (a layer's
    experts share one), so a group costs a few launches and one device-to-host read, not a few per weight."""

    def __init__(self, rank: int, names: Sequence[str], cut: Mapping[int, Mapping[str, CutBox]]):
        self.rank = rank
        by_geometry: dict[tuple, list[str]] = {}
        for name in sorted(names):
            c = cut[rank][name]
            by_geometry.setdefault((c.held, c.padded, c.block), []).append(name)
        self.geometries = [
            _Geometry(ns, cut[rank][ns[0]], _plant_elements(cut[rank][ns[0]])) for ns in by_geometry.values()
        ]
        self.cutting = [n for g in self.geometries if g.plant is not None for n in g.names]
        # per cutting weight: (peer rank, its slice of the peer's grid, the slice of this rank's grid), this rank first
        self.sources: dict[str, list[tuple[int, tuple, tuple]]] = {}
        for name in self.cutting:
            mine = cut[rank][name]
            lo = _block_box(mine)
            self.sources[name] = []
            for r in [rank, *(r for r in sorted(cut) if r != rank and name in cut[r])]:
                if r != rank and _intersect(cut[r][name].held, mine.padded) is None:
                    continue
                theirs = _block_box(cut[r][name])
                both = _intersect(lo, theirs)
                if both is not None:
                    dst = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(both, lo))
                    src = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(both, theirs))
                    self.sources[name].append((r, src, dst))

    @property
    def peers(self) -> list[int]:
        return sorted({r for srcs in self.sources.values() for r, _, _ in srcs} - {self.rank})

    def _staged(self, g: _Geometry, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[len(g.names), *padded] zeros holding each weight's tensor in its held box."""
        expect = tuple(b - a for a, b in g.cut.held)
        for name in g.names:
            if name not in tensors:
                raise MissingTensorError(
                    f"trainer rank {self.rank}: the source handed no {name!r}, whose box {list(g.cut.held)} shares "
                    f"quantization blocks with other trainer ranks (they need its amaxes)"
                )
            if tuple(tensors[name].shape) != expect:
                raise TensorShapeError(
                    f"trainer rank {self.rank}: tensor {name!r} has shape {list(tensors[name].shape)}, expected "
                    f"{list(expect)} (its box {list(g.cut.held)} of the full tensor in the sharded layout)"
                )
        first = tensors[g.names[0]]
        odd = next((n for n in g.names if (tensors[n].dtype, tensors[n].device) != (first.dtype, first.device)), None)
        if odd is not None:  # they are staged as one batch
            raise AmaxExchangeError(
                f"trainer rank {self.rank}: {odd!r} is {tensors[odd].dtype} on {tensors[odd].device} and "
                f"{g.names[0]!r} {first.dtype} on {first.device}: hand the quantized weights of a group whose boxes "
                f"cut blocks in one dtype, on one device"
            )
        out = torch.zeros((len(g.names), *(b - a for a, b in g.cut.padded)), dtype=first.dtype, device=first.device)
        inner = tuple(slice(h0 - p0, h1 - p0) for (h0, h1), (p0, _) in zip(g.cut.held, g.cut.padded))
        out[(slice(None), *inner)] = torch.stack([tensors[n] for n in g.names])
        return out

    def partials(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Per weight: the float32 amax of each block of its padded box over the elements this rank holds."""
        grids = [block_amax(self._staged(g, tensors), g.cut.block) for g in self.geometries]
        if not grids:
            return {}
        host = torch.cat([x.reshape(-1) for x in grids]).cpu().numpy()  # one device-to-host read per group
        out, at = {}, 0
        for g, x in zip(self.geometries, grids):
            shape = tuple(x.shape[1:])
            for name in g.names:
                out[name] = host[at : at + math.prod(shape)].reshape(shape)
                at += math.prod(shape)
        return out

    def combine(self, partials: Mapping[int, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Per cutting weight: the amax of every block of this rank's padded box over all holders (`partials`: trainer
        rank -> its partials, this rank's included). NonFiniteBlockError names a block holding inf/NaN and where."""
        out = {}
        for name in self.cutting:
            grid = None
            for r, src, dst in self.sources[name]:
                theirs = partials.get(r, {}).get(name)
                if theirs is None:
                    raise AmaxExchangeError(
                        f"trainer rank {self.rank}: no block amaxes of {name!r} from trainer rank {r}, which holds "
                        f"part of the blocks this rank's box cuts"
                    )
                if grid is None:
                    grid = np.zeros(_grid_shape(self.geometries, name), dtype=np.float32)
                np.maximum(grid[dst], theirs[src], out=grid[dst])
            if not np.isfinite(grid).all():
                i, j = (int(v) for v in np.argwhere(~np.isfinite(grid))[0])
                lo = _block_box(next(g.cut for g in self.geometries if name in g.names))
                holders = [r for r, _, _ in self.sources[name] if not np.isfinite(partials[r][name]).all()]
                raise NonFiniteBlockError(
                    f"block {[i + lo[0][0], j + lo[1][0]]} of trainer tensor {name!r} holds inf or NaN (in the box "
                    f"of trainer rank(s) {holders}): its fp8 scale would not be finite. Fix the weights (or skip "
                    f"this sync) before packing."
                )
            out[name] = grid
        return out

    def stage(self, tensors: Mapping[str, torch.Tensor], amaxes: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Each cutting weight inside zeros over its padded box, each cut block's amax (over all holders) planted in
        one element outside this rank's box, so the quantizer's own amax of the staged block is the whole block's.
        AmaxExchangeError where the staged dtype cannot hold an amax exactly (holders handed different dtypes) or this
        rank's own elements exceed it (they changed since the exchange)."""
        out, checks = {}, []
        for g in self.geometries:
            if g.plant is None:
                continue
            staged = self._staged(g, tensors)
            rows, cols, bi, bj = g.index(staged.device)
            want = torch.from_numpy(np.stack([amaxes[n][g.plant[2], g.plant[3]] for n in g.names])).to(staged.device)
            staged[:, rows, cols] = want.to(staged.dtype)
            checks.append((g, block_amax(staged, g.cut.block)[:, bi, bj] != want))
            out.update(zip(g.names, staged.unbind(0)))
        if checks and bool(torch.stack([bad.any() for _, bad in checks]).any()):  # one host read per group
            g, bad = next((g, bad) for g, bad in checks if bool(bad.any()))
            name = g.names[int(bad.any(dim=1).nonzero()[0])]
            raise AmaxExchangeError(
                f"trainer rank {self.rank}: the exchanged amaxes of {name!r}'s cut blocks do not stage exactly "
                f"({tensors[name].dtype}): the holders of a block must hand the same dtype, and a tensor must not "
                f"change between the amax exchange and its pack"
            )
        return out


def _grid_shape(geometries: Sequence[_Geometry], name: str) -> tuple[int, int]:
    lo = _block_box(next(g.cut for g in geometries if name in g.names))
    return tuple(b - a for a, b in lo)


def _plant_elements(c: CutBox) -> tuple[np.ndarray, ...] | None:
    """Per cut block of the padded box (one not inside `held`): an element of it outside `held` (a row above or below
    the box, else a column left or right of it) and the block's index; None when the box cuts no block."""
    (bn, bk), (r0, r1), (c0, c1) = c.block, c.padded[0], c.padded[1]
    held_r = (c.held[0][0] - r0, c.held[0][1] - r0)
    held_c = (c.held[1][0] - c0, c.held[1][1] - c0)
    top = np.arange(-(-(r1 - r0) // bn))[:, None] * bn
    bottom = np.minimum(top + bn, r1 - r0)
    left = np.arange(-(-(c1 - c0) // bk))[None, :] * bk
    right = np.minimum(left + bk, c1 - c0)
    row_out = (top < held_r[0]) | (bottom > held_r[1])
    col_out = (left < held_c[0]) | (right > held_c[1])
    rows = np.where(row_out, np.where(top < held_r[0], top, bottom - 1), top) + 0 * left
    cols = np.where(row_out, left, np.where(left < held_c[0], left, right - 1))
    bi, bj = np.nonzero(row_out | col_out)
    if not len(bi):
        return None
    return rows[bi, bj], cols[bi, bj], bi, bj
