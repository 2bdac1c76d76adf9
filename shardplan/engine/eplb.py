"""The live EPLB placement of a vLLM engine worker, read for every sync (vLLM side of docs/eplb.md).

At each update the backend (engine/backend.py) calls `EngineEplb.before_update()`:

1. drain: an asynchronous rebalance (EPLBConfig.use_async, vLLM's default) may have expert rows in flight on its
   worker thread, to be committed layer by layer at the next forward steps; committed after our write, they would
   overwrite fresh experts with stale ones. `EplbState.drain_async()` consumes every pending layer result without
   applying it (each layer's map is committed together with its weights, so the map read next matches what each slot
   holds). It is collective over the EP group, as the update itself is. If the engine's EplbState cannot be found
   while async rebalancing is on, the update is refused (EplbRebalanceInFlight) rather than risked;
2. read the placement: the EplbState's `physical_to_logical_map` (one row of E + R logical ids per MoE layer), or,
   without the EplbState, the inverse of the `logical_to_physical_map` views each MoE layer holds;
3. the backend publishes it for the version (sync/placement.py) and applies the bytes;

and `after_update(placement)` checks that the engine still holds that placement (EplbPlacementChanged otherwise: the
slots would hold the experts of another placement).
"""

from __future__ import annotations

import gc

from shardplan.engine.errors import EplbPlacementChanged, EplbPlacementUnavailable, EplbRebalanceInFlight
from shardplan.plan.names import layer_of
from shardplan.plan.placement import EplbSlots, Placement, PlacementError, PlacementShapeError, make_placement


def _moe_model(model):
    from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

    return get_mixture_of_experts_model(model) or model


def moe_layer_indices(model) -> list[int]:
    """The decoder layer of each of the model's MoE layers, in `moe_layers` order (the rows of vLLM's maps)."""
    moe = _moe_model(model)
    names = {id(m): n for n, m in model.named_modules()}
    layers = getattr(moe, "moe_layers", None)
    if not layers:
        raise EplbPlacementUnavailable(f"{type(moe).__name__} lists no moe_layers: it does not support EPLB")
    return [layer_of(names.get(id(m), "") + ".") for m in layers]


def find_eplb_state(model):
    """The worker's EplbState that balances `model` (held by vLLM's model runner, which the backend is not given),
    or None."""
    from vllm.distributed.eplb.eplb_state import EplbState

    moe = _moe_model(model)
    for obj in gc.get_objects():
        if isinstance(obj, EplbState) and any(
            getattr(ms, "model", None) in (moe, model) for ms in obj.model_states.values()
        ):
            return obj
    return None


def placement_from_logical_maps(model, slots: EplbSlots) -> list[list[int]]:
    """physical_to_logical rows rebuilt from each MoE layer's logical_to_physical_map / logical_replica_count."""
    rows = []
    for layer in _moe_model(model).moe_layers:
        state = getattr(layer, "eplb_state", None)
        l2p = getattr(state, "logical_to_physical_map", None)
        if l2p is None:
            raise EplbPlacementUnavailable(
                "the engine's MoE layers hold no EPLB maps (EplbState.add_model has not "
                "run): the engine must be started with EPLB before syncing"
            )
        counts = state.logical_replica_count.tolist()
        row = [-1] * slots.num_physical_experts
        for expert, slots_of_expert in enumerate(l2p.tolist()):
            for p in slots_of_expert[: counts[expert]]:
                if not 0 <= p < len(row):
                    raise PlacementShapeError(
                        f"the engine maps expert {expert} to slot {p}; the plan has {len(row)} slots per MoE layer"
                    )
                row[p] = expert
        rows.append(row)
    return rows


class EngineEplb:
    """One worker's EPLB: the plan's slots, the model, and (when found) the EplbState."""

    def __init__(self, model, slots: EplbSlots, use_async: bool, eplb_state="find"):
        self.model, self.slots, self.use_async = model, slots, use_async
        self.layers = tuple(moe_layer_indices(model))
        missing = [x for x in self.layers if x not in slots.moe_layers]
        if missing or list(self.layers) != sorted(self.layers):
            raise PlacementShapeError(
                f"the engine's MoE layers {list(self.layers)[:8]} are not among the plan's "
                f"{list(slots.moe_layers)[:8]}: the plan is for another model"
            )
        self.state = find_eplb_state(model) if eplb_state == "find" else eplb_state

    def _model_state(self):
        if self.state is None:
            return None
        moe = _moe_model(self.model)
        return next(
            (ms for ms in self.state.model_states.values() if getattr(ms, "model", None) in (moe, self.model)), None
        )

    def drain(self) -> None:
        ms = self._model_state()
        if ms is None:
            if self.use_async:
                raise EplbRebalanceInFlight(
                    "the engine runs asynchronous EPLB rebalancing (eplb_config.use_async, the default) and its "
                    "EplbState could not be found to drain an in-flight rebalance, which could overwrite the new "
                    "experts with stale ones after the update; start the engine with "
                    "--eplb-config '{\"use_async\": false}' or from a vLLM whose model runner holds an EplbState"
                )
            return
        if getattr(self.state, "is_async", False) and ms.rebalanced:
            self.state.drain_async()
        if ms.rebalanced:
            raise EplbRebalanceInFlight("an EPLB rebalance is still in flight after draining it; retry the update")

    def placement(self) -> Placement:
        ms = self._model_state()
        rows = (
            ms.physical_to_logical_map.tolist()
            if ms is not None
            else placement_from_logical_maps(self.model, self.slots)
        )
        if len(rows) != len(self.layers):
            raise PlacementShapeError(
                f"the engine's physical_to_logical_map has {len(rows)} rows for {len(self.layers)} MoE layers"
            )
        return make_placement(rows, self.slots, layers=self.layers)

    def before_update(self) -> Placement:
        self.drain()
        return self.placement()

    def after_update(self, placement: Placement) -> None:
        now = self.placement()
        if now.digest != placement.digest:
            changed = [x for x in now.rows if now.rows[x] != placement.rows.get(x)]
            raise EplbPlacementChanged(
                f"the engine's EPLB placement changed during the update (MoE layers "
                f"{changed[:8]}): the experts were written for placement {placement.digest}, "
                f"the engine now routes by {now.digest}; sync again"
            )


__all__ = [
    "EngineEplb",
    "EplbPlacementChanged",
    "EplbPlacementUnavailable",
    "EplbRebalanceInFlight",
    "PlacementError",
    "find_eplb_state",
    "moe_layer_indices",
    "placement_from_logical_maps",
]
