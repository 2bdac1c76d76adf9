"""EPLB placements at every sync: the consumer publishes the placement its engine holds, the trainer binds to it.

A plan recorded with redundant expert slots (plan/placement.py) names physical slots, not experts. Before each
version's bytes move, every consumer rank sets `v<V>/placement/<consumer>` on the control channel: the placement
its engine will hold while the bytes land (read after any in-flight rebalance was drained; engine/eplb.py). Each
trainer lane reads its consumer's key before packing that consumer's first group (EplbPacker.begin), binds the
consumer's plan to it and packs; a consumer whose placement does not arrive within the timeout fails its lane only,
named (PlacementNotPublished), like any other peer failure.

Both sides build the pack layout from the same *unbound* plan: one segment per slot, whatever the placement, so the
join stamps stay valid across rebalances and only which expert tensor fills each slot changes (the trainer aliases
slot names to expert tensors at pack time). What the two sides agree on per version is the key itself, set once by the
consumer and read by the trainer; the consumer checks after the update that its engine still holds that placement
(engine/eplb.py: EplbPlacementChanged otherwise). Each trainer lane also records the digest it bound to
(`v<V>/bound/<trainer>/<consumer>`), and the consumer checks, once the bytes arrived, that every trainer bound to the
placement its engine published and holds (check_bound: PlacementNotBound naming the trainer otherwise, the version
incomplete): a placement key overwritten in between fails that version by name, and the next binds again.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from shardplan.plan import ir
from shardplan.plan.names import (
    base_group,
    expert_of,
    group_of,
    is_scale,
    layer_of,
    slot_of,
    slot_to_expert,
    with_expert,
)
from shardplan.plan.placement import (
    EplbSlots,
    Placement,
    PlacementBinder,
    PlacementError,
    bound_name,
    make_placement,
    with_slot_aliases,
)
from shardplan.sync.adapters import ReplayPacker, spans_of
from shardplan.sync.control import bound_key, placement_key
from shardplan.sync.stages import Span
from shardplan.transport.base import Control, Peer, PeerError, PeerTimeout, consumer_name, deadline_after, left


class PlacementNotPublished(PeerTimeout, PlacementError):
    """A consumer did not publish its engine's EPLB placement for this version in time."""


class PlacementNotBound(PeerError, PlacementError):
    """A trainer bound a consumer's slots to another placement than the one its engine published and holds."""


def publish_placement(control: Control, version: int, consumer: Peer, placement: Placement) -> None:
    control.set(
        placement_key(version, consumer), json.dumps({"digest": placement.digest, **json.loads(placement.to_json())})
    )


def read_placement(control: Control, version: int, consumer: Peer, slots: EplbSlots, timeout_s: float) -> Placement:
    """The consumer's placement for `version`, checked against the plan's slots (named PlacementError otherwise)."""
    try:
        text = control.get(placement_key(version, consumer), timeout_s, consumer, "its EPLB placement")
    except PeerTimeout as e:
        raise PlacementNotPublished(
            consumer,
            f"{consumer} published no EPLB placement for version {version} within "
            f"{timeout_s:.0f} s ({e}); its engine must run the shardplan backend "
            f"with the same EPLB plan",
        ) from None
    try:
        record = json.loads(text)
        layers, rows = record["layers"], record["rows"]
    except (ValueError, KeyError, TypeError):
        raise PlacementError(
            f"{consumer}'s placement for version {version} is not a placement: {text[:200]!r}"
        ) from None
    if not isinstance(layers, list) or not set(layers) <= set(slots.moe_layers):
        raise PlacementError(
            f"{consumer}'s placement covers MoE layers {str(layers)[:80]}, the plan "
            f"{list(slots.moe_layers)[:8]}: trainer and engine read different plans"
        )
    placement = make_placement(rows, slots, layers=tuple(layers))
    if record.get("digest") != placement.digest:
        raise PlacementError(f"{consumer}'s placement for version {version} does not match its digest")
    return placement


def record_bound(control: Control, version: int, trainer: Peer, consumer: Peer, placement: Placement) -> None:
    """The trainer's side: which placement it binds `consumer`'s slots to for `version` (before any of its bytes)."""
    control.set(bound_key(version, trainer, consumer), placement.digest)


def check_bound(
    control: Control, version: int, consumer: Peer, trainers: Sequence[Peer], placement: Placement, timeout_s: float
) -> None:
    """The consumer's side, once the bytes arrived: every trainer that served it bound to `placement` (the one its
    engine published and holds); PlacementNotBound naming the first that did not."""
    deadline = deadline_after(timeout_s)
    for t in trainers:
        digest = control.get(bound_key(version, t, consumer), left(deadline), t, "the EPLB placement it bound to")
        if digest != placement.digest:
            raise PlacementNotBound(
                t,
                f"bound {consumer}'s slots of version {version} to EPLB placement {digest[:16]}, not "
                f"{placement.digest[:16]}, the one its engine published and holds: the slots hold another "
                f"placement's experts; the version is incomplete and the next one binds again",
            )


def bind_spans(spans: Sequence[Span], placement: Placement) -> tuple[Span, ...]:
    """Spans of the unbound plan with each slot name read as the expert `placement` puts there. Keeps `only` (a
    sharded packer's holder); no direct sends: a slot's tensor changes with the placement."""
    return tuple(Span(s.offset, s.nbytes, tuple(bound_name(n, placement) for n in s.sources), s.only) for s in spans)


@dataclass(frozen=True)
class SlotSpans:
    """What the Coordinator needs to schedule an EPLB plan per placement: every consumer's spans per group with slot
    names unbound, and the plan's slots. Trainers holding every expert (or their boxes of every expert alike) can
    serve a slot whatever the placement, and one schedule serves all versions; trainers holding a subset of the
    experts whole (expert parallel) serve a slot only while its placed expert is theirs, so each version's schedule
    follows the placements the consumers published for it."""

    slots: EplbSlots
    spans: Mapping[int, Mapping[str, tuple[Span, ...]]]
    _parsed: dict = field(default_factory=dict, compare=False, repr=False)  # slot name -> _slot_parts

    @functools.cached_property
    def experts(self) -> frozenset[str]:
        """Every expert tensor some slot the spans read may hold (what a trainer must report holding, or not)."""
        names = {n for by_group in self.spans.values() for ss in by_group.values() for s in ss for n in s.sources}
        return frozenset(any_expert(names, self.slots))

    def placement_matters(self, held: Mapping[int, frozenset[str] | None]) -> bool:
        """Whether some trainer holds a subset of the experts the slots may hold (only it may serve a slot's bytes,
        and only while the placement puts one of its experts there)."""
        return any(h is not None and not self.experts <= h for h in held.values())

    def bound(self, consumer: int, placement: Placement) -> dict[str, tuple[Span, ...]]:
        """bind_spans of each of the consumer's groups; each slot name parsed once over all placements (a rebalance
        of Kimi-K2 TP32 rebinds ~100k spans)."""
        return {g: tuple(self._bind(s, placement) for s in ss) for g, ss in self.spans[consumer].items()}

    def _bind(self, span: Span, placement: Placement) -> Span:
        parts = [self._slot_parts(n) for n in span.sources]
        if not any(parts):
            return Span(span.offset, span.nbytes, span.sources, span.only) if span.direct else span
        try:
            names = tuple(
                n if p is None else f"{p[0]}{placement.rows[p[1]][p[2]]}{p[3]}" for n, p in zip(span.sources, parts)
            )
        except (KeyError, IndexError):  # outside the placement: bound_name names it
            return bind_spans((span,), placement)[0]
        return Span(span.offset, span.nbytes, names, span.only)

    def _slot_parts(self, name: str) -> tuple[str, int, int, str] | None:
        """(text before the expert index, layer, slot, text after it) of a slot name; None for other names."""
        parts = self._parsed.get(name, False)
        if parts is False:
            slot = slot_of(name)
            if slot is None:
                parts = None
            else:
                head, tail = slot_to_expert(name, "{}").split("{}")
                parts = (head, layer_of(name), slot, tail)
            self._parsed[name] = parts
        return parts

    def placements(self, control: Control, version: int, consumers: Sequence[int], timeout_s: float) -> dict:
        """consumer -> the placement it published for `version` (waiting at most `timeout_s` in all), or the slots'
        initial one where none (or none valid) came: that consumer's trainer lanes then fail by name when they read it
        (PlacementNotPublished, PlacementError), and a trainer lacking a placed expert refuses to pack it."""
        deadline, out = deadline_after(timeout_s), {}
        for c in consumers:
            try:
                out[c] = read_placement(control, version, consumer_name(c), self.slots, left(deadline))
            except PlacementError:
                out[c] = self.slots.initial()
        return out


def any_expert(names, slots: EplbSlots) -> set[str]:
    """Each slot name in `names`, and each expert name of a MoE layer with slots, as the tensor of every logical
    expert: what those slots may read under some placement."""
    out: set[str] = set()
    for n in names:
        if slot_of(n) is not None:
            template = slot_to_expert(n, "{}")
        elif expert_of(n) is not None and layer_of(n) in slots.moe_layers:
            template = with_expert(n, "{}")
        else:
            continue
        out.update(template.format(e) for e in range(slots.num_logical_experts))
    return out


def slot_spans(packer) -> SlotSpans | None:
    """An EplbPacker's SlotSpans (for the Coordinator); None for other packers."""
    if not isinstance(packer, EplbPacker):
        return None
    return SlotSpans(packer.slots, spans_of(packer.inner))


def expert_sources(plans: Sequence[ir.RankPlan], slots: EplbSlots, sources: Mapping[str, ir.TensorMeta]) -> set[str]:
    """Every checkpoint tensor the plans may read under some placement: what they read outside the slots, plus every
    logical expert of each slot tensor they read (a trainer must hold all of them)."""
    read = set().union(*(p.sources_read() | {f.source for f in p.fallbacks} for p in plans))
    out = {n for n in read if slot_of(n) is None}
    out |= any_expert(read - out, slots)
    missing = [n for n in out if n not in sources]
    if missing:
        raise PlacementError(f"the plan's slots read {missing[:4]}..., which its checkpoint table lacks")
    return out


class EplbPacker:
    """A Packer (sync.stages) for plans with EPLB slots: one ReplayPacker of the *unbound* plans (so each consumer's
    pack layout and stamp are the ones its Unpacker builds from the same file, whatever the placement), fed at every
    pack with each slot's name aliased to the tensor of the expert that consumer's published placement puts there
    (plan/placement.with_slot_aliases). `inner`: a ShardedPacker of the unbound plans instead, for sharded trainers
    holding the same box of every expert (engine.sharding.eplb_slot_shards): a slot is then aliased to the local
    shard of its expert. EP-sharded trainers (each a subset of the experts) are not supported with EPLB."""

    def __init__(
        self,
        plans: Sequence[ir.RankPlan],
        sources: Mapping[str, ir.TensorMeta],
        slots: EplbSlots,
        control: Control | None = None,
        *,
        timeout_s: float = 60.0,
        inner=None,
        **packer_options,
    ):
        for p in plans:
            PlacementBinder(p, slots)  # refuses slot tensors that are fallbacks
        self.slots, self.control, self.timeout_s = slots, control, timeout_s
        self.inner = ReplayPacker(plans, sources, **packer_options) if inner is None else inner
        self.placements: dict[int, Placement] = {c: slots.initial() for c in self.inner.consumers()}
        self._plans = {p.rank: p for p in plans}
        self._made_scales = bool(packer_options.get("quantizer"))  # a quantizing pack makes them: trainers hold none
        self._slot_names: dict[int, dict[str, tuple[str, ...]]] = {}  # plan rank -> group -> slot tensors it reads
        self._subset_names: dict[tuple, tuple[str, ...]] = {}  # (plan rank, group, segments) -> slot tensors read

    def begin(self, version: int, consumer: int) -> Placement:
        """Before packing `consumer`'s groups of `version`: read the placement it published."""
        if self.control is None:
            raise PlacementError("EplbPacker needs the control channel to read each consumer's placement")
        placement = read_placement(self.control, version, consumer_name(consumer), self.slots, self.timeout_s)
        self.placements[consumer] = placement
        return placement

    def use(self, consumer: int, placement: Placement) -> None:
        """Pack `consumer`'s next groups for `placement` (what begin() does with the published one)."""
        self.placements[consumer] = placement

    def consumers(self):
        return self.inner.consumers()

    def stamp(self, consumer: int) -> str:
        return self.inner.stamp(consumer)

    def groups(self):
        return self.inner.groups()

    def spans(self, consumer: int, group: str):
        """The inner spans with slot names read as the experts of the consumer's current placement (what the
        schedule checks trainers hold; every expert, for whole-tensor trainers)."""
        return bind_spans(self.inner.spans(consumer, group), self.placements[consumer])

    def _slot_names_of(self, rank: int) -> dict[str, tuple[str, ...]]:
        """Group -> the slot tensors plan rank `rank` reads there (at its first pack: a rank's names cost time)."""
        if rank not in self._slot_names:
            by_group: dict[str, tuple[str, ...]] = {}
            for n in sorted(self._plans[rank].sources_read()):
                if slot_of(n) is not None and not (self._made_scales and is_scale(n)):
                    by_group[group_of(n)] = by_group.get(group_of(n), ()) + (n,)
            self._slot_names[rank] = by_group
        return self._slot_names[rank]

    def _packed_slot_names(self, consumer: int, group: str, segments) -> tuple[str, ...]:
        """The slot tensors `segments` of the consumer's group read: all the group's, unless this whole-tensor trainer
        packs part of it (holding some of the experts, it packs the slots whose placed expert it holds). A sharded
        inner's trainers hold their box of every expert: all."""
        rank = self.inner.replicas.plan_rank(consumer)
        names = self._slot_names_of(rank).get(base_group(group), ())
        if not names or not isinstance(self.inner, ReplayPacker):
            return names
        key = (rank, group, tuple(segments))
        picked = self._subset_names.get(key)
        if picked is None:
            spans = self.inner.spans(consumer, group)
            if len(segments) == len(spans):
                return names
            read = {n for i in segments for n in spans[i].sources}
            picked = tuple(n for n in names if n in read)
            if len(self._subset_names) >= 1024:  # schedules follow placements: keep the recent ones
                self._subset_names.clear()
            self._subset_names[key] = picked
        return picked

    def pack(self, consumer, group, tensors, out, segments):
        aliased = with_slot_aliases(
            tensors,
            self._packed_slot_names(consumer, group, segments),
            self.placements[consumer],
            f"the trainer packing {group} for consumer {consumer}",
        )
        self.inner.pack(consumer, group, aliased, out, segments)


def make_packer(
    plans: Sequence[ir.RankPlan],
    sources: Mapping[str, ir.TensorMeta],
    slots: EplbSlots | None,
    control: Control | None = None,
    *,
    timeout_s: float = 60.0,
    **packer_options,
):
    """The trainer's Packer for a plan file: EplbPacker when it has EPLB slots (`header.eplb`), else ReplayPacker.
    `quantizer=header.quantizer` (a block-FP8 plan) makes ReplayPacker quantize the trainer's BF16 weights."""
    if slots is None:
        return ReplayPacker(plans, sources, **packer_options)
    return EplbPacker(plans, sources, slots, control, timeout_s=timeout_s, **packer_options)
