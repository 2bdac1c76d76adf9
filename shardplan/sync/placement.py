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
(engine/eplb.py: EplbPlacementChanged otherwise).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Mapping, Sequence

from shardplan.plan import ir
from shardplan.plan.names import base_group, group_of, is_scale, slot_of
from shardplan.plan.placement import (
    EplbSlots,
    Placement,
    PlacementBinder,
    PlacementError,
    bound_name,
    make_placement,
    with_slot_aliases,
)
from shardplan.sync.adapters import ReplayPacker
from shardplan.transport.base import Control, Peer, PeerTimeout, consumer_name


class PlacementNotPublished(PeerTimeout, PlacementError):
    """A consumer did not publish its engine's EPLB placement for this version in time."""


def placement_key(version: int, consumer: Peer) -> str:
    return f"v{version}/placement/{consumer}"


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


def expert_sources(plans: Sequence[ir.RankPlan], slots: EplbSlots, sources: Mapping[str, ir.TensorMeta]) -> set[str]:
    """Every checkpoint tensor the plans may read under some placement: what they read outside the slots, plus every
    logical expert of each slot tensor they read (a trainer must hold all of them)."""
    out: set[str] = set()
    for plan in plans:
        for name in plan.sources_read() | {f.source for f in plan.fallbacks}:
            slot = slot_of(name)
            if slot is None:
                out.add(name)
                continue
            head, _, tail = name.partition(f".experts.slot.{slot}.")
            out.update(f"{head}.experts.{e}.{tail}" for e in range(slots.num_logical_experts))
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
        placement = self.placements[consumer]
        return tuple(
            # keeps `only` (a sharded inner's holder); no direct sends: a slot's tensor changes with the placement
            dataclasses.replace(s, sources=tuple(bound_name(n, placement) for n in s.sources), direct=False)
            for s in self.inner.spans(consumer, group)
        )

    def _slot_names_of(self, rank: int) -> dict[str, tuple[str, ...]]:
        """Group -> the slot tensors plan rank `rank` reads there (at its first pack: a rank's names cost time)."""
        if rank not in self._slot_names:
            by_group: dict[str, tuple[str, ...]] = {}
            for n in sorted(self._plans[rank].sources_read()):
                if slot_of(n) is not None and not (self._made_scales and is_scale(n)):
                    by_group[group_of(n)] = by_group.get(group_of(n), ()) + (n,)
            self._slot_names[rank] = by_group
        return self._slot_names[rank]

    def pack(self, consumer, group, tensors, out, segments):
        aliased = with_slot_aliases(
            tensors,
            self._slot_names_of(self.inner.replicas.plan_rank(consumer)).get(base_group(group), ()),
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
