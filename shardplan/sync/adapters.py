"""Adapters from the sync engine's stage Protocols to the runtime: replay (trainer), apply (consumer), and the
sharded planner (trainers holding shards)."""

from __future__ import annotations

import functools
import hashlib
import operator
from typing import Mapping, Sequence

import numpy as np
import torch

from shardplan.plan.columns import columns_of
from shardplan.plan.interp import to_dtype
from shardplan.plan.ir import TensorMeta
from shardplan.plan.names import base_group, group_of, group_order
from shardplan.runtime.apply import Applier, FallbackRequiredError
from shardplan.runtime.pack import FallbackSlot, PackLayout, fallback_slots, reads_digest, sharded_bases
from shardplan.runtime.quantize import QuantizingReplayer
from shardplan.runtime.replay import Replayer, run_items
from shardplan.runtime.shards import AmaxExchangeError, CutGroup
from shardplan.runtime.tensors import StaleBindingError, check_tensor
from shardplan.sync.stages import Packer, Replicas, Span

# Pipeline unit of ReplayPacker / ApplyUnpacker: a decoder layer's group larger than this is moved in parts (see
# PackLayout.from_plans). The sync's fill (pack the first part) and drain (apply the last) are one part each, so a
# part is sized to take far longer on the wire than to pack or apply (docs/benchmarks.md, "Sync over NCCL"). Trainer
# and consumer must agree.
PART_BYTES = 256 << 20
# ReplayPacker: a segment at least this large that is one contiguous range of one source is sent from the trainer's
# tensor itself (Span.direct), not copied into staging; smaller ones cost more as a message than as a copy.
DIRECT_BYTES = 256 << 10


def spans_of(packer: Packer) -> dict[int, dict[str, tuple[Span, ...]]]:
    """What the Coordinator needs: every consumer's spans per group."""
    return {c: {g: tuple(packer.spans(c, g)) for g in packer.groups()} for c in packer.consumers()}


def _segment_sources(replayer: Replayer, seg) -> tuple[str, ...]:
    plan = next(p for p in replayer.plans if p.rank == seg.refs[0].rank)
    names = columns_of(plan).sources_of(seg.refs[0].index)
    # quantizing: a scale comes from its weight (trainers hold no scales)
    rename = getattr(replayer, "trainer_name", None)
    return tuple(dict.fromkeys(map(rename, names))) if rename else names


def _ordered_groups(pack_layouts) -> tuple[str, ...]:
    return tuple(sorted({g for lay in pack_layouts for g in lay.group_names}, key=group_order))


class _Packs:
    """Bound replays per (key, segment subset, output buffer), reused while the source hands the same tensors.

    A binding holds views of the tensors it was bound to (and, on CUDA, a graph of copies between them). So every
    pack first checks that the tensors the source handed for *this* sync are the bound ones (the same object, or the
    same storage address, shape and dtype: the bound tensors are alive, so an equal address is the same storage). A
    source that hands new tensors (gathered per layer, DTensor.full_tensor(), a fresh state dict) gets them packed:
    the subset is bound again, and after the first such change the key is never cached again (one-shot binds), so
    the packer does not keep a source's per-sync tensors alive. `cache=False` never caches; `True` always does."""

    def __init__(self, cache: bool | None = None):
        self.cache = cache
        self.bound: dict[tuple, list] = {}  # sub key -> [replayer, subset, names read, {out address: bound}, volatile]
        self._subsets: dict[tuple, list[tuple]] = {}  # key -> its subsets' sub keys, oldest first

    def run(
        self, key, replayer: Replayer, segments: Sequence[int], tensors: Mapping[str, torch.Tensor], out: torch.Tensor
    ) -> None:
        # the common case (one trainer serves the whole group) keyed without hashing every segment index
        whole = len(segments) == len(replayer.layout.segments)
        sub_key = (key, "all") if whole else (key, tuple(segments))
        entry = self.bound.get(sub_key)
        if entry is None or entry[0] is not replayer:
            sub = replayer if whole else replayer.subset(segments)
            new = entry is None
            entry = self.bound[sub_key] = [replayer, sub, sorted(sub.sources_read()), {}, False]
            if new and not whole:  # schedules following EPLB placements ask other subsets over time: keep a few
                subsets = self._subsets.setdefault(key, [])
                subsets.append(sub_key)
                if len(subsets) > 4:
                    self.bound.pop(subsets.pop(0), None)
        _, sub, names, by_buffer, volatile = entry
        bound = by_buffer.get(out.data_ptr())
        if bound is not None:
            if _same_tensors(bound, names, tensors):
                try:
                    bound.pack(check=True)  # check(): the bound tensors and buffer still have their storage
                    return
                except StaleBindingError:
                    pass
            by_buffer.pop(out.data_ptr())
            entry[4] = volatile = True  # this source hands new tensors: bind per sync from now on
        keep = self.cache or (self.cache is None and not volatile)
        # a binding packed once is not worth a CUDA graph: capturing one cost more than the pack it saves
        # (docs/benchmarks.md, "bound again per sync")
        options = {} if keep else {"cuda_graph": False}
        fresh = sub.bind({n: tensors.get(n) for n in names}, out[: sub.layout.nbytes], **options)
        fresh.pack(check=False)
        fresh.given = tuple(fresh.tensors[n] for n in names)  # in `names` order, for _same_tensors' identity pass
        if keep:
            if len(by_buffer) >= 4:
                by_buffer.pop(next(iter(by_buffer)))
            by_buffer[out.data_ptr()] = fresh


def _same_tensors(bound, names: Sequence[str], given: Mapping[str, torch.Tensor]) -> bool:
    """The source handed the bound tensors again: the same objects (one C-level identity pass over `names`, much
    cheaper than reading each tensor's address), else per tensor the same storage address, shape and dtype. Whether
    a bound object's storage was swapped in place (`t.data = x`, `set_`) is pack(check=True)'s data-pointer check."""
    if all(map(operator.is_, map(given.get, names), bound.given)):
        return True
    for n in names:
        t, b = given.get(n), bound.tensors[n]
        if t is b:
            continue
        if (
            t is None
            or t.data_ptr() != b.data_ptr()
            or t.shape != b.shape
            or t.dtype != b.dtype
            or t.stride() != b.stride()
            or t.device != b.device
        ):
            return False
    return True


def layout_stamp(plan_ranks: Sequence[int], *parts) -> str:
    """What both sides compare before the first byte moves: the plan ranks a buffer is for and a digest of its pack
    layout (segments, order, dtypes, destinations), of what each write reads (`reads_digest`: source regions and op
    chains) and of the fallback tensors' slots."""
    h = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    return f"rank{'+'.join(map(str, plan_ranks))}:{h}"


class ReplayPacker:
    """Packer over shardplan.runtime.replay for trainers that hold checkpoint tensors whole (replicated, or gathered per
    group by the WeightSource): one Replayer per consumer plan; any trainer holding a segment's sources may serve it.
    Fallback tensors of a plan travel whole, after their layer's replayed bytes (`fallback_slots`).
    `cache_bindings`: see _Packs (None: cache while the source hands the same tensors every sync).
    `quantizer`: for a block-FP8 plan whose trainer holds high-precision weights, the plan header's `quantizer` id:
    each consumer's bytes are packed by a QuantizingReplayer (fp8 weights and scales made from the trainer's
    bfloat16/float16/float32 `X.weight` at every pack; no scale tensors on the trainer). "" (default): the trainer
    holds the plan's tensors as they are (an FP8 plan then needs fp8 weights and scales, like a checkpoint).
    `replicas`: how many replicas of the plan's layout the sync feeds (sync.stages.Replicas: consumer ids beyond the
    plan's ranks); each is packed from the same replayers, with bindings of its own."""

    def __init__(
        self,
        plans,
        sources: Mapping[str, TensorMeta],
        *,
        alignment: int = 256,
        device: torch.device | str | None = None,
        max_group_bytes: int | None = PART_BYTES,
        cache_bindings: bool | None = None,
        quantizer: str = "",
        direct_bytes: int | None = DIRECT_BYTES,
        replicas: int = 1,
    ):
        self.sources = dict(sources)
        # `direct_bytes`: the smallest segment sent straight from a trainer tensor (DIRECT_BYTES); None: none is
        self.direct_bytes = None if quantizer else direct_bytes
        self._direct: dict[tuple[int, str], dict[int, tuple[str, int, int, torch.dtype]]] = {}
        make = functools.partial(QuantizingReplayer, quantizer=quantizer) if quantizer else Replayer
        self.replayers = {
            p.rank: make(p, sources, alignment=alignment, device=device, max_group_bytes=max_group_bytes) for p in plans
        }
        self.fallbacks = {p.rank: fallback_slots(p, self.replayers[p.rank].layout, self.sources) for p in plans}
        groups = set(_ordered_groups(r.layout for r in self.replayers.values()))
        groups.update(g for slots in self.fallbacks.values() for g in slots)
        self._groups = tuple(sorted(groups, key=group_order))
        self._packs = _Packs(cache_bindings)
        self._plans, self._reads = {p.rank: p for p in plans}, {}
        self.replicas = Replicas.of(list(self.replayers), replicas)

    def consumers(self):
        return self.replicas.consumers(self.replayers)

    def stamp(self, consumer: int) -> str:
        rank = self.replicas.plan_rank(consumer)
        reads = self._reads.get(rank)
        if reads is None:  # what the consumer's writes read, from the plan as given (before any FP8 rebasing)
            reads = self._reads[rank] = reads_digest(self._plans[rank])
        return layout_stamp((rank,), self.replayers[rank].layout.digest, reads, self.fallbacks[rank])

    def groups(self):
        return self._groups

    def spans(self, consumer: int, group: str):
        rank = self.replicas.plan_rank(consumer)
        rep = self.replayers[rank]
        out = []
        if group in rep.layout.group_names:
            rep_g, direct = rep.for_group(group), self._direct_segments(rank, group)
            out = [
                Span(s.offset, s.nbytes, _segment_sources(rep_g, s), direct=i in direct)
                for i, s in enumerate(rep_g.layout.segments)
            ]
        out += [Span(f.offset, f.nbytes, (f.name,)) for f in self.fallbacks[rank].get(group, ())]
        return tuple(out)

    def _direct_segments(self, rank: int, group: str) -> dict[int, tuple[str, int, int, torch.dtype]]:
        """Segment -> (source, first element, elements, dtype) of plan rank `rank`'s segments of the group that are
        one contiguous range of one source in its own dtype (a pure view of collapsed geometry [n], stride 1), of
        direct_bytes or more."""
        key = (rank, group)
        if key not in self._direct:
            out = {}
            rep_g = self.replayers[rank].for_group(group)
            for (src_dtype, dst_dtype, sizes, strides), segs in rep_g._runs if self.direct_bytes is not None else ():
                dtype = to_dtype(dst_dtype)
                if src_dtype != dst_dtype or len(sizes) != 1 or tuple(strides) != (1,):
                    continue
                if sizes[0] * dtype.itemsize < self.direct_bytes:
                    continue
                for seg, _, name, src_offset in run_items(rep_g.plans, rep_g.layout.segments, segs):
                    out[seg] = (name, src_offset, sizes[0], dtype)
            self._direct[key] = out
        return self._direct[key]

    def direct_view(self, consumer: int, group: str, tensors, segment: int) -> torch.Tensor | None:
        """The bytes of a direct segment (see spans) as a uint8 view of the trainer's tensor, or None where that
        tensor is not the contiguous one of the plan's dtype and size (the segment is then packed as usual)."""
        found = self._direct_segments(self.replicas.plan_rank(consumer), group).get(segment)
        if found is None:  # a schedule made from other spans than this packer's: packed, as any other segment
            return None
        name, offset, numel, dtype = found
        t = tensors.get(name)
        meta = self.sources.get(name)
        if t is None or meta is None or t.dtype != dtype or not t.is_contiguous() or t.numel() != meta.numel:
            return None
        return t.reshape(-1)[offset : offset + numel].view(torch.uint8)

    def pack(self, consumer, group, tensors, out, segments):
        rank = self.replicas.plan_rank(consumer)
        rep = self.replayers[rank]
        num_replayed = len(rep.for_group(group).layout.segments) if group in rep.layout.group_names else 0
        replayed = [i for i in segments if i < num_replayed]
        if replayed:  # bindings per consumer: each replica's lane packs into its own slots, concurrently
            self._packs.run((consumer, group), rep.for_group(group), replayed, tensors, out)
        slots = self.fallbacks[rank].get(group, ())
        for i in segments:
            if i >= num_replayed:  # a fallback tensor, whole, as bytes
                f = slots[i - num_replayed]
                t = tensors.get(f.name)
                check_tensor("trainer tensor", f.name, t, self.sources[f.name], out.device)
                out[f.offset : f.offset + f.nbytes].copy_(t.reshape(-1).view(torch.uint8))


class ApplyUnpacker:
    """Unpacker over shardplan.runtime.apply: the consumer's own plan, its layout, its live params. A plan with
    fallbacks needs `sources` (the plan file's table) and `fallback_loader(name, tensor)`, typically the real vLLM
    loader: `lambda name, t: model.load_weights([(name, t)])`; it gets each fallback tensor whole (a copy it may keep)
    once its group arrived."""

    def __init__(
        self,
        plan,
        params: Mapping[str, torch.Tensor],
        *,
        alignment: int = 256,
        max_group_bytes: int | None = PART_BYTES,
        sources: Mapping[str, TensorMeta] | None = None,
        fallback_loader=None,
    ):
        self.layout = PackLayout.from_plans(plan, alignment, max_group_bytes)
        self.fallbacks: dict[str, tuple[FallbackSlot, ...]] = {}
        if plan.fallbacks:
            if sources is None or fallback_loader is None:
                raise FallbackRequiredError(
                    f"consumer rank {plan.rank}: its plan has {len(plan.fallbacks)} fallback tensors "
                    f"({plan.fallbacks[0].source}, ...): pass sources= (the plan file's table) and "
                    f"fallback_loader= (the real loader, which gets each of them whole)"
                )
            self.fallbacks = fallback_slots(plan, self.layout, sources)
        self.applier = Applier(plan, self.layout, params, fallback_loader=fallback_loader)
        self.sources, self.fallback_loader = sources, fallback_loader
        self._stamp = layout_stamp((plan.rank,), self.layout.digest, reads_digest(plan), self.fallbacks)

    def stamp(self) -> str:
        return self._stamp

    def sizes(self):
        sizes = {g.name: g.nbytes for g in self.layout.groups}
        for group, slots in self.fallbacks.items():
            sizes[group] = slots[-1].offset + slots[-1].nbytes
        return sizes

    def apply(self, group, buffer):
        if group in self.layout.group_names:
            self.applier.apply_group(group, buffer[: self.layout.group(group).nbytes])
        for f in self.fallbacks.get(group, ()):
            meta = self.sources[f.name]
            tensor = buffer[f.offset : f.offset + f.nbytes].view(to_dtype(meta.dtype)).view(meta.shape).clone()
            self.fallback_loader(f.name, tensor)


def _sharded_parts(sharded, consumer: int, alignment: int):
    """Per trainer rank: the (trainer, consumer) sub-plan's layout; the consumer's group buffer is their
    concatenation in trainer order, each part aligned (so every part is a buffer of its own for Applier/Replayer)."""
    return {t: PackLayout.from_plans(p, alignment) for t, p in sharded.for_consumer(consumer).items()}


def _sharded_stamp(consumer: int, parts: Mapping[int, PackLayout], plans: Mapping[int, object]) -> str:
    return layout_stamp((consumer,), [(t, lay.digest, reads_digest(plans[t])) for t, lay in sorted(parts.items())])


class ShardedPacker:
    """Packer for sharded trainers (shardplan.runtime.shards.ShardedPlan): trainer `rank` packs, for each consumer, the
    pieces plan_shards gave it, from its local shards; each piece can come from that trainer only. `replicas`: as
    ReplayPacker's (every replica gets the same pieces from the same trainers). A quantizing plan (`sharded.quantizer`,
    a block-FP8 plan over high-precision trainers) packs each consumer's pieces with a QuantizingReplayer over the
    rank's local weight boxes, bitwise the quantization of the whole tensor. Where boxes cut blocks (`sharded.cut`),
    the holders exchange block amaxes before packing a group (`partial_amaxes` -> every peer's -> `set_amaxes`; the
    sync does it on the control channel) and pack from staged tensors (`stage`)."""

    def __init__(
        self,
        sharded,
        rank: int,
        *,
        alignment: int = 256,
        device: torch.device | str | None = None,
        cache_bindings: bool | None = None,
        replicas: int = 1,
    ):
        self.sharded, self.rank, self.alignment = sharded, rank, alignment
        self.consumer_ranks = sorted({c for _, c in sharded.plans})
        self.parts = {c: _sharded_parts(sharded, c, alignment) for c in self.consumer_ranks}
        self._groups = _ordered_groups(lay for parts in self.parts.values() for lay in parts.values())
        mine = {c: p for (t, c), p in sharded.plans.items() if t == rank}
        make = Replayer
        if sharded.quantizer:
            make = functools.partial(QuantizingReplayer, quantizer=sharded.quantizer, scales_with_reads=False)
        self.replayers = {
            c: make(p, sharded.sources[rank], alignment=alignment, device=device) for c, p in mine.items()
        }
        self._packs = _Packs(cache_bindings)
        self.replicas = Replicas.of(self.consumer_ranks, replicas)
        self.cut = sharded.cut.get(rank, {})
        self._cut_groups: dict[str, CutGroup | None] = {}
        self._amaxes: dict[str, dict] = {}  # source group -> this sync's exchanged amaxes of its cut blocks

    def consumers(self):
        return self.replicas.consumers(self.consumer_ranks)

    # -- blocks cut between trainers (runtime.shards.CutBox) --
    def _cut_group(self, group: str) -> CutGroup | None:
        base = base_group(group)
        if base not in self._cut_groups:
            names = [n for n in self.cut if group_of(n) == base]
            self._cut_groups[base] = CutGroup(self.rank, names, self.sharded.cut) if names else None
        return self._cut_groups[base]

    def amax_groups(self) -> list[str]:
        """The source groups whose block amaxes this rank publishes (it holds part of a block cut between trainers)."""
        return sorted({group_of(n) for n in self.cut}, key=group_order)

    def amax_peers(self, group: str) -> list[int]:
        """The trainer ranks whose partial amaxes of `group` this rank needs (its boxes there cut blocks)."""
        cut = self._cut_group(group)
        return [] if cut is None else cut.peers

    def partial_amaxes(self, group: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """This rank's float32 block amaxes of its part of the cut blocks of `group` (tensors as `pack` takes)."""
        cut = self._cut_group(group)
        return {} if cut is None else cut.partials(tensors)

    def set_amaxes(self, group: str, partials: Mapping[int, Mapping[str, np.ndarray]]) -> None:
        """Every holder's partial_amaxes of `group` (trainer rank -> them; this rank's and amax_peers' at least):
        the amaxes this rank plants when it stages the group's cut weights this sync."""
        cut = self._cut_group(group)
        if cut is not None:
            self._amaxes[base_group(group)] = cut.combine(partials)

    def stage(self, group: str, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The source's tensors of `group` with each cut weight inside its staged box, its blocks' amaxes planted."""
        cut = self._cut_group(group)
        if cut is None or not cut.cutting or isinstance(tensors, _Staged):
            return tensors
        amaxes = self._amaxes.get(base_group(group))
        if amaxes is None:
            raise AmaxExchangeError(
                f"trainer rank {self.rank}: its boxes of {cut.cutting[0]!r} and {len(cut.cutting) - 1} other "
                f"weight(s) of {group!r} cut quantization blocks, and no amaxes were exchanged for them: call "
                f"set_amaxes() with every holder's partial_amaxes() before packing (the sync engine does it per "
                f"version)"
            )
        out = _Staged(tensors)
        out.update(cut.stage(tensors, amaxes))
        return out

    def stamp(self, consumer: int) -> str:
        rank = self.replicas.plan_rank(consumer)
        return _sharded_stamp(rank, self.parts[rank], self.sharded.for_consumer(rank))

    def groups(self):
        return self._groups

    def spans(self, consumer: int, group: str):
        parts, out = self.parts[self.replicas.plan_rank(consumer)], []
        for t, base in sharded_bases(parts, group, self.alignment).items():
            out += [Span(base + s.offset, s.nbytes, (), (t,)) for s in parts[t].group(group).segments]
        return tuple(out)

    def pack(self, consumer, group, tensors, out, segments):
        tensors = self.stage(group, tensors) if self.cut else tensors
        parts = self.parts[self.replicas.plan_rank(consumer)]
        base = sharded_bases(parts, group, self.alignment)[self.rank]
        rep_g = self.replayers[self.replicas.plan_rank(consumer)].for_group(group)
        first = sum(
            len(parts[t].group(group).segments)
            for t in sorted(parts)
            if t < self.rank and group in parts[t].group_names
        )
        mine = [i - first for i in segments]
        self._packs.run((consumer, group), rep_g, mine, tensors, out[base : base + rep_g.layout.nbytes])


class _Staged(dict):
    """A group's source tensors with the cut weights staged (ShardedPacker.stage): packed as they are."""


class ShardedUnpacker:
    """Unpacker for a consumer fed by sharded trainers: one Applier per trainer part of each group."""

    def __init__(self, sharded, consumer: int, params: Mapping[str, torch.Tensor], *, alignment: int = 256):
        self.alignment = alignment
        self.parts = _sharded_parts(sharded, consumer, alignment)
        plans = sharded.for_consumer(consumer)
        self.appliers = {t: Applier(plans[t], lay, params) for t, lay in self.parts.items()}
        groups = {g for lay in self.parts.values() for g in lay.group_names}
        self._sizes = {}
        for g in groups:
            bases = sharded_bases(self.parts, g, alignment)
            last = max(bases, key=bases.get)
            self._sizes[g] = bases[last] + self.parts[last].group(g).nbytes
        self._stamp = _sharded_stamp(consumer, self.parts, plans)

    def sizes(self):
        return dict(self._sizes)

    def stamp(self) -> str:
        return self._stamp

    def apply(self, group, buffer):
        for t, base in sharded_bases(self.parts, group, self.alignment).items():
            n = self.parts[t].group(group).nbytes
            self.appliers[t].apply_group(group, buffer[base : base + n])
