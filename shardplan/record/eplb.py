"""Recording with EPLB's redundant expert slots (`shardplan record --ep --eplb-redundant R`) on a CPU box.

vLLM 0.32 accepts `enable_eplb` only on CUDA, ROCm or XPU (ParallelConfig's check), so, as record/parallel.py fakes
the parallel state, this module fakes what EPLB changes at build and load time:

* the config: `enable_eplb` and `eplb_config.num_redundant_experts` are set on the already-validated ParallelConfig,
  so each MoE layer is built with E + R physical slots, (E + R) / EP per rank, exactly as on a GPU engine;
* the placement: vLLM's loader maps physical slot p to the checkpoint expert of its *initial* placement
  (`EplbState.build_initial_global_physical_to_logical_map`, p % E). While recording, that map is the identity over
  E + R slots and the recorder offers a checkpoint tensor per slot (`experts.<p>` for p >= E too, shaped like expert
  p % E), so each recorded expert write names the slot it fills; `slot_plan` renames those sources to
  `experts.slot.<p>` (shardplan.plan.placement), the hole a placement binds at every sync.

`load_with_placement` is the reference: vLLM's real loader with the mapping built from a given placement, one MoE
layer at a time (the mapping is per model in DeepSeek-V3's loader, per layer in the placement).
"""

from __future__ import annotations

import contextlib

from shardplan.plan import ir
from shardplan.plan.names import expert_of, layer_of, slot_name, with_expert
from shardplan.plan.placement import EplbSlots, Placement, rename_leaf
from shardplan.record.build import LayoutRejected


def num_logical_experts(config: dict) -> int:
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if config.get(key):
            return int(config[key])
    return 0


def eplb_slots(tensors, layout, num_redundant: int, config: dict, label: str) -> EplbSlots:
    """The slots a layout has with `num_redundant` redundant experts; LayoutRejected with vLLM's reason when EPLB
    cannot run there."""
    num_experts = num_logical_experts(config)
    ep_size = layout.dp * layout.tp
    if type(num_redundant) is not int or num_redundant < 0:
        raise LayoutRejected(
            f"--eplb-redundant must be a non-negative integer (vLLM's num_redundant_experts), got {num_redundant!r}"
        )
    if not layout.ep or not num_experts:
        raise LayoutRejected(f"--eplb-redundant needs --ep and a mixture-of-experts model ({label})")
    if ep_size <= 1:
        raise LayoutRejected(
            f"vLLM's EPLB needs an expert-parallel group of more than one rank (TP x DP > 1), {label} has {ep_size}"
        )
    if (num_experts + num_redundant) % ep_size:
        raise LayoutRejected(
            f"vLLM's EPLB splits experts evenly over EP ranks: {num_experts} experts + "
            f"{num_redundant} redundant do not divide over {ep_size} EP ranks ({label}); choose R "
            f"so that E + R is a multiple of {ep_size}"
        )
    layers = sorted({layer_of(n) for n, _, _ in tensors if expert_of(n) is not None and layer_of(n) >= 0})
    return EplbSlots(num_experts, num_redundant, ep_size, tuple(layers))


def enable_eplb(vllm_config, num_redundant: int) -> None:
    """EPLB on a validated config, past the CUDA-only check (nothing here runs the rebalancer)."""
    pc = vllm_config.parallel_config
    pc.enable_eplb = True
    pc.eplb_config.num_redundant_experts = num_redundant


def recording_tensors(tensors, slots: EplbSlots) -> list[tuple]:
    """The checkpoint plus one tensor per redundant slot (`experts.<p>`, p >= E, shaped like expert p % E)."""
    out = list(tensors)
    for name, shape, dtype in tensors:
        e = expert_of(name)
        if e is not None and layer_of(name) in slots.moe_layers:
            for p in range(slots.num_logical_experts + e, slots.num_physical_experts, slots.num_logical_experts):
                out.append((with_expert(name, p), shape, dtype))
    return out


@contextlib.contextmanager
def placement_map(row_of_layer):
    """vLLM's loader builds its expert mapping from `build_initial_global_physical_to_logical_map(E, R)`: answer
    `row_of_layer(E, R)` instead, for the duration."""
    from vllm.distributed.eplb.eplb_state import EplbState

    original = EplbState.__dict__["build_initial_global_physical_to_logical_map"]
    EplbState.build_initial_global_physical_to_logical_map = staticmethod(row_of_layer)
    try:
        yield
    finally:
        EplbState.build_initial_global_physical_to_logical_map = original


def identity_slots():
    """While recording: slot p reads checkpoint tensor `experts.<p>`."""
    return placement_map(lambda num_experts, num_redundant: list(range(num_experts + num_redundant)))


def slot_plan(plan: ir.RankPlan, slots: EplbSlots) -> ir.RankPlan:
    """A plan recorded under identity_slots with every expert source renamed to its slot (`experts.slot.<p>`)."""

    def name(n: str) -> str:
        e = expert_of(n)
        return slot_name(n, e) if e is not None and layer_of(n) in slots.moe_layers else n

    writes = tuple(ir.Write(w.param, w.dst, ir.View(rename_leaf(w.src.leaf, name), w.src.region)) for w in plan.writes)
    fallbacks = tuple(ir.Fallback(name(f.source), f.op, f.reason, f.loader) for f in plan.fallbacks)
    # which real experts a rank reads depends on the placement: only non-expert names stay listed
    not_needed = tuple(n for n in plan.not_needed if expert_of(n) is None or layer_of(n) not in slots.moe_layers)
    return ir.RankPlan(plan.rank, plan.params, writes, fallbacks, not_needed)


def load_with_placement(model, checkpoint: dict, placement: Placement | None, slots: EplbSlots) -> None:
    """vLLM's real `model.load_weights` with the expert mapping built from `placement` (None: vLLM's initial
    placement, what its own reload uses). Non-expert tensors load once; then each MoE layer's experts load with that
    layer's row as the map. Call inside record.build.loading_context."""
    rest = [(n, t) for n, t in checkpoint.items() if expert_of(n) is None or layer_of(n) not in slots.moe_layers]
    model.load_weights(iter(rest))
    for layer in slots.moe_layers:
        experts = [(n, t) for n, t in checkpoint.items() if expert_of(n) is not None and layer_of(n) == layer]
        if placement is None:
            model.load_weights(iter(experts))
            continue
        row = list(placement.rows[layer])

        def mapping(num_experts, num_redundant, row=row):
            assert num_experts + num_redundant == len(row), (num_experts, num_redundant, len(row))
            return row

        with placement_map(mapping):
            model.load_weights(iter(experts))
