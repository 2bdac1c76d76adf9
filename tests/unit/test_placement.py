"""EPLB placements without vLLM: binding a slot-templated plan (plan/placement.py), the plan header's `eplb` field,
and bad input (wrong shape, a slot pointing at a non-existent expert, a plan without redundant slots on an engine with
them) as named errors. The bound plans are proved against vLLM's loader in tests/integration/test_eplb.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan.plan.file.errors import PlanFieldError
from shardplan.plan.file.format import decode
from shardplan.plan.placement import (
    EplbPlanMismatch,
    EplbSlots,
    PlacementBinder,
    PlacementError,
    PlacementExpertError,
    PlacementShapeError,
    bind_placement,
    check_engine_slots,
    make_placement,
    with_slot_aliases,
)
from shardplan.runtime.apply import Applier, params_from_plan
from shardplan.runtime.replay import Replayer
from tests.unit.eplb_helpers import eplb_plan_file, expected_slots, random_placement
from tests.unit.planfile_helpers import raw_parts, seal


def _tensors(real, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {m.name: torch.randn(m.shape, generator=g).to(torch.bfloat16) for m in real}


@settings(max_examples=25, deadline=None)
@given(
    num_experts=st.sampled_from([2, 4, 6]),
    num_redundant=st.integers(1, 8),
    num_ep=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_bound_plan_fills_every_slot_with_its_placed_expert(num_experts, num_redundant, num_ep, seed):
    if (num_experts + num_redundant) % num_ep:
        num_redundant += num_ep - (num_experts + num_redundant) % num_ep
    plan_file, real = eplb_plan_file(num_experts=num_experts, num_redundant=num_redundant, num_ep=num_ep)
    slots = plan_file.header.eplb
    assert (slots.num_logical_experts, slots.num_redundant_experts) == (num_experts, num_redundant)
    tensors = _tensors(real, seed)
    placement = random_placement(slots, seed)
    for rank in plan_file.ranks:
        binder = PlacementBinder(plan_file.rank(rank), slots)
        bound = binder.bind(placement)
        assert binder.bind(placement) is bound  # cached by digest
        assert not any(".slot." in n for n in bound.sources_read())
        params = params_from_plan(bound, fill=float("nan"))
        replayer = Replayer(bound, plan_file.sources)
        Applier(bound, replayer.layout, params).apply(replayer.pack(tensors))
        expected_slots(params, placement, slots, rank, tensors)
        for name, t in params.items():
            assert not torch.isnan(t.float()).any(), name
        # the sync's path: the unbound plan's Replayer fed each slot's expert under the slot's name writes the same
        unbound = plan_file.rank(rank)
        slot_names = sorted(n for n in unbound.sources_read() if ".slot." in n)
        aliased = Replayer(unbound, plan_file.sources)
        same = params_from_plan(unbound, fill=float("nan"))
        Applier(unbound, aliased.layout, same).apply(aliased.pack(with_slot_aliases(tensors, slot_names, placement)))
        for name, t in params.items():
            assert torch.equal(t.view(torch.int16), same[name].view(torch.int16)), name


def test_initial_placement_is_vllms():
    slots = EplbSlots(4, 6, 2, (1, 2))
    assert slots.initial().rows == {1: (0, 1, 2, 3, 0, 1, 2, 3, 0, 1), 2: (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)}
    assert slots.slots_per_rank == 5


def test_placement_of_wrong_shape_is_named():
    slots = EplbSlots(4, 2, 2, (1, 2))
    with pytest.raises(PlacementShapeError, match="1 rows; the plan's model has 2 MoE layers"):
        make_placement([[0, 1, 2, 3, 0, 1]], slots)
    with pytest.raises(PlacementShapeError, match="row of layer 2 has 4 slots; the plan has 6"):
        make_placement([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3]], slots)
    with pytest.raises(PlacementShapeError, match="rows"):
        make_placement("0,1,2", slots)
    plan_file, _ = eplb_plan_file()
    binder = PlacementBinder(plan_file.rank(0), plan_file.header.eplb)
    other = make_placement([[0, 1, 2, 3, 0, 1]], EplbSlots(4, 2, 2, (1,)))
    with pytest.raises(
        PlacementShapeError,
        match="plan rank 0 reads model.layers.2.mlp.experts.slot.0.down_proj.weight, outside the placement",
    ):
        binder.bind(other)
    with pytest.raises(PlacementShapeError, match=r"rows for layers \[3\]"):
        make_placement([[0, 1, 2, 3, 0, 1]], EplbSlots(4, 2, 2, (1, 2)), layers=(3,))


@pytest.mark.parametrize("bad", [4, -1, 7, True, 1.0, None])
def test_slot_pointing_at_a_non_existent_expert_is_named(bad):
    slots = EplbSlots(4, 2, 2, (1, 2))
    with pytest.raises(PlacementExpertError, match=r"layer 2 slot 3 holds expert .*experts 0\.\.3"):
        make_placement([[0, 1, 2, 3, 0, 1], [0, 1, 2, bad, 0, 1]], slots)


def test_torch_tensor_map_is_accepted():
    slots = EplbSlots(4, 2, 2, (1, 2))
    placement = make_placement(torch.tensor([[0, 2, 1, 3, 0, 1], [3, 2, 1, 0, 0, 0]]), slots)
    assert placement.rows[2] == (3, 2, 1, 0, 0, 0)
    assert placement.digest == make_placement([[0, 2, 1, 3, 0, 1], [3, 2, 1, 0, 0, 0]], slots).digest
    assert placement.digest != slots.initial().digest


def test_plan_without_redundant_slots_on_an_engine_with_them_is_named():
    with pytest.raises(EplbPlanMismatch, match="recorded without EPLB slots.*--eplb-redundant 8"):
        check_engine_slots(None, True, 8, "plans/x.plan")
    with pytest.raises(EplbPlanMismatch, match="recorded without EPLB slots.*num_redundant_experts=0"):
        check_engine_slots(None, True, 0, "plans/x.plan")  # experts move even without redundant slots
    with pytest.raises(EplbPlanMismatch, match="2 redundant\\) but the engine runs without EPLB"):
        check_engine_slots(EplbSlots(4, 2, 2, (1,)), False, 0, "plans/x.plan")
    with pytest.raises(EplbPlanMismatch, match="recorded with 2 .* num_redundant_experts=4"):
        check_engine_slots(EplbSlots(4, 2, 2, (1,)), True, 4, "plans/x.plan")
    with pytest.raises(EplbPlanMismatch, match="over 2 EP ranks, the engine over 4"):
        check_engine_slots(EplbSlots(4, 4, 2, (1,)), True, 4, "plans/x.plan", engine_num_logical=4, engine_ep=4)
    check_engine_slots(None, False, 0, "plans/x.plan")
    check_engine_slots(EplbSlots(4, 2, 2, (1,)), True, 2, "plans/x.plan", engine_num_logical=4, engine_ep=2)
    check_engine_slots(EplbSlots(4, 0, 2, (1,)), True, 0, "plans/x.plan")


def test_unbound_plan_reads_no_real_expert():
    """Used without binding, a slot plan asks the trainer for `experts.slot.<p>` tensors nobody has: it cannot
    silently load the initial placement."""
    plan_file, real = eplb_plan_file()
    tensors = _tensors(real)
    with pytest.raises(Exception, match="slot"):
        Replayer(plan_file.rank(0), plan_file.sources).pack(tensors)
    bound = bind_placement(plan_file.rank(0), plan_file.header.eplb, [[0, 1, 2, 3, 0, 1]] * 2)
    Replayer(bound, plan_file.sources).pack(tensors)


def test_eplb_slots_reject_bad_values():
    with pytest.raises(PlacementError, match="do not split evenly over 4 EP ranks"):
        EplbSlots(4, 2, 4, (1,))
    with pytest.raises(PlacementError, match="num_redundant_experts must be a non-negative integer"):
        EplbSlots(4, -1, 2, (1,))
    with pytest.raises(PlacementError, match="moe_layers must be increasing"):
        EplbSlots(4, 2, 2, (2, 1))
    with pytest.raises(PlacementError, match="in that order"):
        EplbSlots.from_dict(
            {"num_redundant_experts": 2, "num_logical_experts": 4, "num_ep_ranks": 2, "moe_layers": [1]}
        )


@pytest.mark.parametrize(
    "eplb",
    [
        {"num_logical_experts": 4},
        [4, 2, 2, [1]],
        "x",
        {"num_logical_experts": 4, "num_redundant_experts": 3, "num_ep_ranks": 2, "moe_layers": [1, 2]},
        {"num_logical_experts": 4, "num_redundant_experts": 2, "num_ep_ranks": 2, "moe_layers": [1, "2"]},
        {
            "num_logical_experts": 4,
            "num_redundant_experts": 4,
            "num_ep_ranks": 4,
            "moe_layers": [1, 2],
        },  # not the layout's EP group (tp2)
        {"num_logical_experts": 2**40, "num_redundant_experts": 0, "num_ep_ranks": 2, "moe_layers": [1, 2]},
    ],
)
def test_plan_file_with_a_bad_eplb_header_is_refused(eplb):
    plan_file, _ = eplb_plan_file()
    from shardplan.plan.file.format import encode

    data = encode(
        plan_file.body,
        model="toy-moe",
        architecture="ToyMoe",
        config_sha256="0" * 64,
        layout=plan_file.header.layout,
        dtype="bfloat16",
        vllm_version="0.32.0",
        eplb=plan_file.header.eplb,
    )
    header, body = raw_parts(data)
    assert header["eplb"] == plan_file.header.eplb.to_dict()
    header["eplb"] = eplb
    with pytest.raises(PlanFieldError, match="header.eplb"):
        decode(seal(header, body))
    del header["eplb"]
    header["eplb"] = plan_file.header.eplb.to_dict()
    decode(seal(header, body))


def test_trainer_lacking_a_placed_expert_is_named():
    plan_file, real = eplb_plan_file()
    tensors = _tensors(real)
    del tensors["model.layers.2.mlp.experts.3.down_proj.weight"]
    placement = make_placement([[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 3, 1]], plan_file.header.eplb)
    with pytest.raises(
        PlacementError,
        match=r"lacks model.layers.2.mlp.experts.3.down_proj.weight, which slot "
        r"model.layers.2.mlp.experts.slot.4.down_proj.weight holds",
    ):
        with_slot_aliases(tensors, ["model.layers.2.mlp.experts.slot.4.down_proj.weight"], placement)
