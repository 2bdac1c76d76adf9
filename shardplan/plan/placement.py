"""EPLB placements: which logical expert each physical expert slot holds, and binding a slot-templated plan to one.

With vLLM's expert-parallel load balancer (EPLB) an MoE layer has E logical experts in E + R physical slots (R
redundant), (E + R) / EP slots per EP rank, and the rebalancer moves experts between slots at runtime. A plan recorded
with `--eplb-redundant R` does not name a checkpoint expert for a slot: each expert write reads
`...experts.slot.<p>.<weight>` (p = the physical slot, an affine hole like any other), and the plan header's `eplb`
field (`EplbSlots`) says so. At every sync the placement (vLLM's `physical_to_logical_map`, one row of E + R logical
ids per MoE layer) is an input, used in one of two equivalent ways:

* `PlacementBinder.bind(placement)` rewrites each slot name to the checkpoint expert the slot holds now
  (`...experts.<placement[layer][p]>.<weight>`): an ordinary RankPlan (reference interpreter, verification);
* `with_slot_aliases(tensors, slot_names, placement)` hands a Replayer of the *unbound* plan each slot's expert
  tensor under the slot's name: the sync's path (sync/placement.py), because the pack layout of the unbound plan has
  one segment per slot whatever the placement, so trainer and consumer build the same layout (and stamp) from the same
  file once, and a rebalance changes only which tensor fills each slot. (A bound plan's layout is not fixed: two slots
  of one rank holding the same expert share one segment.)

No torch, no vLLM: the trainer binds with this module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Mapping, Sequence

from shardplan.errors import ShardplanError
from shardplan.plan import ir
from shardplan.plan.names import expert_of, layer_of, slot_name, slot_of, slot_to_expert, with_expert

MAX_PHYSICAL_EXPERTS = 65536  # E + R, and the EP size, a plan header may declare (vLLM models have <= 512 experts)


class PlacementError(ShardplanError):
    """A placement that cannot be bound to a plan (its shape, its values, or the plan has no slots)."""


class PlacementShapeError(PlacementError):
    """The placement has the wrong number of MoE layers or of physical slots per layer."""


class PlacementExpertError(PlacementError):
    """A physical slot points at an expert the model does not have."""


class EplbPlanMismatch(PlacementError):
    """A plan's redundant slots (none, or another count) differ from the engine's: its writes would fill the wrong
    slots, or leave slots unwritten."""


@dataclass(frozen=True)
class EplbSlots:
    """The redundant-slot shape a plan was recorded for (the plan header's `eplb` field)."""

    num_logical_experts: int
    num_redundant_experts: int
    num_ep_ranks: int
    moe_layers: tuple[int, ...]  # decoder layers with routed experts, in order: the rows of physical_to_logical_map

    def __post_init__(self):
        for f in ("num_logical_experts", "num_ep_ranks"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise PlacementError(f"eplb.{f} must be a positive integer, got {v!r}")
        if type(self.num_redundant_experts) is not int or self.num_redundant_experts < 0:
            raise PlacementError(
                f"eplb.num_redundant_experts must be a non-negative integer, got {self.num_redundant_experts!r}"
            )
        if self.num_physical_experts > MAX_PHYSICAL_EXPERTS or self.num_ep_ranks > MAX_PHYSICAL_EXPERTS:
            raise PlacementError(
                f"eplb: {self.num_physical_experts} physical slots over {self.num_ep_ranks} EP ranks "
                f"exceed the limit of {MAX_PHYSICAL_EXPERTS}"
            )
        if self.num_physical_experts % self.num_ep_ranks:
            raise PlacementError(
                f"eplb: {self.num_physical_experts} physical slots do not split evenly over "
                f"{self.num_ep_ranks} EP ranks (vLLM requires it)"
            )
        if (
            not self.moe_layers
            or any(type(x) is not int or x < 0 for x in self.moe_layers)
            or list(self.moe_layers) != sorted(set(self.moe_layers))
        ):
            raise PlacementError(f"eplb.moe_layers must be increasing layer indices, got {list(self.moe_layers)!r}")

    @property
    def num_physical_experts(self) -> int:
        return self.num_logical_experts + self.num_redundant_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical_experts // self.num_ep_ranks

    def to_dict(self) -> dict:
        return {
            "num_logical_experts": self.num_logical_experts,
            "num_redundant_experts": self.num_redundant_experts,
            "num_ep_ranks": self.num_ep_ranks,
            "moe_layers": list(self.moe_layers),
        }

    @classmethod
    def from_dict(cls, d) -> "EplbSlots":
        keys = ("num_logical_experts", "num_redundant_experts", "num_ep_ranks", "moe_layers")
        if not isinstance(d, dict) or tuple(d) != keys or not isinstance(d["moe_layers"], (list, tuple)):
            raise PlacementError(f"eplb is {{{', '.join(keys)}}} in that order, got {d!r}")
        return cls(d["num_logical_experts"], d["num_redundant_experts"], d["num_ep_ranks"], tuple(d["moe_layers"]))

    def initial(self) -> "Placement":
        """vLLM's placement at start-up (EplbState.build_initial_global_physical_to_logical_map)."""
        row = tuple(p % self.num_logical_experts for p in range(self.num_physical_experts))
        return make_placement([row] * len(self.moe_layers), self)


@dataclass(frozen=True)
class Placement:
    """Logical expert of every physical slot, per MoE layer (decoder layer -> row of E + R ids); `digest` names it."""

    rows: Mapping[int, tuple[int, ...]]
    digest: str

    def to_json(self) -> str:
        return json.dumps({"layers": sorted(self.rows), "rows": [list(self.rows[k]) for k in sorted(self.rows)]})


def make_placement(physical_to_logical, slots: EplbSlots, layers: tuple[int, ...] | None = None) -> Placement:
    """From vLLM's `physical_to_logical_map` ([moe_layers, E + R]; a tensor, array or nested lists), checked against
    the plan's slots: PlacementShapeError / PlacementExpertError name the first bad row or slot. `layers`: the decoder
    layers of the rows when they are not all of the plan's MoE layers (a pipeline stage's engine holds its own)."""
    rows = physical_to_logical.tolist() if hasattr(physical_to_logical, "tolist") else physical_to_logical
    layers = slots.moe_layers if layers is None else tuple(layers)
    if not set(layers) <= set(slots.moe_layers) or list(layers) != sorted(set(layers)):
        raise PlacementShapeError(
            f"placement rows for layers {list(layers)[:8]}: the plan's MoE layers are {list(slots.moe_layers)[:8]}..."
        )
    num_layers, num_slots, num_experts = len(layers), slots.num_physical_experts, slots.num_logical_experts
    if not isinstance(rows, (list, tuple)) or len(rows) != num_layers:
        got = len(rows) if isinstance(rows, (list, tuple)) else type(rows).__name__
        raise PlacementShapeError(
            f"placement has {got} rows; the plan's model has {num_layers} MoE layers "
            f"({list(slots.moe_layers)[:8]}...): pass vLLM's physical_to_logical_map "
            f"[{num_layers}, {num_slots}] of the whole model"
        )
    out = {}
    for layer, row in zip(layers, rows):
        if not isinstance(row, (list, tuple)) or len(row) != num_slots:
            got = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
            raise PlacementShapeError(
                f"placement row of layer {layer} has {got} slots; the plan has {num_slots} "
                f"physical slots per MoE layer ({num_experts} experts + "
                f"{slots.num_redundant_experts} redundant): the engine's num_redundant_experts "
                f"differs from the plan's"
            )
        for p, e in enumerate(row):
            if type(e) is not int or not 0 <= e < num_experts:
                raise PlacementExpertError(
                    f"placement: layer {layer} slot {p} holds expert {e!r}, but the model "
                    f"has experts 0..{num_experts - 1}; the map is not this model's (or is "
                    f"mid-update)"
                )
        out[layer] = tuple(row)
    text = json.dumps([[k, list(v)] for k, v in out.items()]).encode()
    return Placement(out, hashlib.sha256(text).hexdigest()[:16])


def check_engine_slots(
    slots: EplbSlots | None,
    engine_eplb: bool,
    engine_num_redundant: int,
    where: str,
    engine_num_logical: int | None = None,
    engine_ep: int | None = None,
) -> None:
    """EplbPlanMismatch unless the plan's EPLB slots are the engine's: an engine with EPLB needs a plan recorded with
    `--eplb-redundant` (its experts move, even with 0 redundant slots), one without EPLB a plan without."""
    if engine_eplb and slots is None:
        raise EplbPlanMismatch(
            f"{where} was recorded without EPLB slots, the engine runs EPLB with num_redundant_experts="
            f"{engine_num_redundant}: its experts move between slots, and the plan would fill each slot from the "
            f"initial placement; record the plan with `shardplan record ... --ep --eplb-redundant "
            f"{engine_num_redundant}`"
        )
    if slots is not None and not engine_eplb:
        raise EplbPlanMismatch(
            f"{where} has EPLB slots ({slots.num_redundant_experts} redundant) but the engine runs "
            f"without EPLB: use the plan recorded without --eplb-redundant"
        )
    if slots is None:
        return
    if slots.num_redundant_experts != engine_num_redundant:
        raise EplbPlanMismatch(
            f"{where} was recorded with {slots.num_redundant_experts} redundant expert slots, the "
            f"engine runs num_redundant_experts={engine_num_redundant}: its slots would be filled "
            f"wrong or not at all; record the plan with `shardplan record ... --ep "
            f"--eplb-redundant {engine_num_redundant}`"
        )
    if engine_num_logical is not None and engine_num_logical != slots.num_logical_experts:
        raise EplbPlanMismatch(
            f"{where} has {slots.num_logical_experts} logical experts, the engine {engine_num_logical}"
        )
    if engine_ep is not None and engine_ep != slots.num_ep_ranks:
        raise EplbPlanMismatch(f"{where} splits slots over {slots.num_ep_ranks} EP ranks, the engine over {engine_ep}")


class PlacementBinder:
    """Binds one rank's slot-templated plan to placements. The slot writes are found once; `bind` rebuilds only
    those (a Kimi-K2 rank: ~60k of its ~70k writes, tens of ms) and keeps the last few results by placement digest."""

    def __init__(self, plan: ir.RankPlan, slots: EplbSlots, cache_size: int = 4):
        self.plan, self.slots, self._cache_size = plan, slots, cache_size
        self._slot_writes = [
            i for i, w in enumerate(plan.writes) if any(slot_of(n) is not None for n in ir.sources(w.src.leaf))
        ]
        self._cache: dict[str, ir.RankPlan] = {}
        if plan.fallbacks and any(slot_of(f.source) is not None for f in plan.fallbacks):
            raise PlacementError(
                f"rank {plan.rank}: an expert slot's tensor is a fallback (its loader could not be "
                f"recorded); EPLB plans need every expert write recorded"
            )

    def bind(self, placement: Placement) -> ir.RankPlan:
        """The plan with every `experts.slot.<p>` name replaced by the checkpoint expert slot p holds."""
        if placement.digest in self._cache:
            return self._cache[placement.digest]

        def name(n: str) -> str:
            return bound_name(n, placement, self.plan.rank)

        writes = list(self.plan.writes)
        for i in self._slot_writes:
            w = writes[i]
            writes[i] = ir.Write(w.param, w.dst, ir.View(rename_leaf(w.src.leaf, name), w.src.region))
        bound = ir.RankPlan(self.plan.rank, self.plan.params, tuple(writes), self.plan.fallbacks, self.plan.not_needed)
        if len(self._cache) >= self._cache_size:
            self._cache.pop(next(iter(self._cache)))
        self._cache[placement.digest] = bound
        return bound


def bound_name(name: str, placement: Placement, rank: int | None = None) -> str:
    """`...layers.<l>...experts.slot.<p>.w` -> `...experts.<placement[l][p]>.w`; other names unchanged."""
    slot = slot_of(name)
    if slot is None:
        return name
    layer = layer_of(name)
    row = placement.rows.get(layer)
    if row is None or slot >= len(row):
        raise PlacementShapeError(
            f"{'plan rank ' + str(rank) + ' ' if rank is not None else ''}reads {name}, outside "
            f"the placement (layers {list(placement.rows)[:8]}..., {len(row or ())} slots)"
        )
    return slot_to_expert(name, row[slot])


def with_slot_aliases(tensors: Mapping, slot_names, placement: Placement, who: str = "") -> dict:
    """`tensors` (checkpoint name -> tensor) plus each slot name -> the tensor of the expert the slot holds: what a
    Replayer of the *unbound* plan packs from. Its pack layout is the consumer's (both built from the same unbound
    plan, independent of the placement); only which tensor fills each slot changes."""
    out = dict(tensors)
    for n in slot_names:
        source = bound_name(n, placement)
        try:
            out[n] = tensors[source]
        except KeyError:
            raise PlacementError(
                f"{who or 'the trainer'} lacks {source}, which slot {n} holds under placement "
                f"{placement.digest}: with EPLB a trainer must hold every expert of the layers it "
                f"serves whole (any expert can move to any slot)"
            ) from None
    return out


def rename_leaf(leaf: ir.Leaf, name) -> ir.Leaf:
    """The leaf with every checkpoint name n replaced by name(n)."""
    if isinstance(leaf, ir.Source):
        return ir.Source(name(leaf.name))
    if isinstance(leaf, ir.Call):
        return ir.Call(
            leaf.op,
            leaf.args,
            leaf.kwargs,
            tuple(ir.View(rename_leaf(v.leaf, name), v.region) for v in leaf.inputs),
            leaf.out,
        )
    if isinstance(leaf, ir.Update):
        return ir.Update(
            rename_leaf(leaf.base, name), leaf.region, ir.View(rename_leaf(leaf.value.leaf, name), leaf.value.region)
        )
    return leaf


def bind_placement(plan: ir.RankPlan, slots: EplbSlots, physical_to_logical) -> ir.RankPlan:
    """One-shot form of PlacementBinder(plan, slots).bind(make_placement(physical_to_logical, slots))."""
    return PlacementBinder(plan, slots).bind(make_placement(physical_to_logical, slots))


def slot_sources(sources: Sequence[ir.TensorMeta], slots: EplbSlots) -> list[ir.TensorMeta]:
    """The plan-side tensors of the physical slots (`experts.slot.<p>`), shaped like the experts they hold."""
    first: dict[str, ir.TensorMeta] = {}
    for m in sources:
        if layer_of(m.name) in slots.moe_layers and expert_of(m.name) is not None:
            first.setdefault(with_expert(m.name, "{}"), m)
    return [
        ir.TensorMeta(slot_name(m.name, p), m.shape, m.dtype)
        for m in first.values()
        for p in range(slots.num_physical_experts)
    ]
