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


@settings(max_examples=20, deadline=None)
@given(
    num_experts=st.sampled_from([2, 4, 6]),
    num_redundant=st.integers(0, 6),
    num_ep=st.sampled_from([1, 2, 4]),
    num_trainers=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_per_placement_schedule_gives_each_slot_to_a_holder_of_its_placed_expert(
    num_experts, num_redundant, num_ep, num_trainers, seed
):
    """Trainers holding random subsets of the tensors whole (every tensor by at least one), the Coordinator given the
    plan's SlotSpans: for each version's published placement, every piece of the schedule goes to a trainer holding
    every tensor its segments read under that placement; packing each piece with only that trainer's tensors and
    applying the consumer's buffer fills every slot with its placed expert, bitwise, nothing left NaN. A version whose
    placements repeat reuses its schedule."""
    import json
    import random

    from shardplan.sync import ApplyUnpacker, Coordinator, SyncConfig, spans_of
    from shardplan.sync.control import join, result_key
    from shardplan.sync.placement import EplbPacker, publish_placement, slot_spans
    from shardplan.sync.schedule import Schedule
    from shardplan.transport import Control, consumer_name, trainer_name

    if (num_experts + num_redundant) % num_ep:
        num_redundant += num_ep - (num_experts + num_redundant) % num_ep
    plan_file, real = eplb_plan_file(num_experts=num_experts, num_redundant=num_redundant, num_ep=num_ep)
    slots, plans = plan_file.header.eplb, [plan_file.rank(r) for r in plan_file.ranks]
    tensors, rng = _tensors(real, seed), random.Random(seed)
    held: dict[int, set[str]] = {t: set() for t in range(num_trainers)}
    for m in real:
        for t in rng.sample(range(num_trainers), rng.randint(1, num_trainers)):
            held[t].add(m.name)
    control = Control.serve("127.0.0.1")
    packers = {t: EplbPacker(plans, plan_file.sources, slots, control, timeout_s=5) for t in held}
    coordinator = Coordinator(
        control, spans_of(packers[0]), packers[0].groups(), num_trainers, SyncConfig(timeout_s=5),
        eplb=slot_spans(packers[0]),
    )  # fmt: skip
    for t, names in held.items():
        join(control, trainer_name(t), None if len(names) == len(real) else frozenset(names))
    for c in plan_file.ranks:
        join(control, consumer_name(c))
    schedules = []
    for version, placement_seed in ((1, seed), (2, seed + 1), (3, seed + 1)):
        placement = random_placement(slots, placement_seed)
        for c in plan_file.ranks:
            publish_placement(control, version, consumer_name(c), placement)
        ann = coordinator.announce(version)
        assert set(ann.members) == {trainer_name(t) for t in held} | {consumer_name(c) for c in plan_file.ranks}
        for name in ann.members:  # every rank reports the version done, as a sync would
            control.set(result_key(version, name), json.dumps({"ok": True, "epoch": ann.members[name], "errors": {}}))
        schedules.append(ann.schedule_id)
        schedule = Schedule.from_json(control.get(f"schedule/{ann.schedule_id}", 5, "coordinator"))
        for c in plan_file.ranks:
            for t in held:
                packers[t].begin(version, c)
            params = params_from_plan(plans[c], fill=float("nan"))
            unpacker = ApplyUnpacker(plans[c], params)
            for gi, group in enumerate(schedule.groups):
                spans = packers[0].spans(c, group)
                buffer = torch.zeros(unpacker.sizes()[group], dtype=torch.uint8)
                for piece in schedule.of(c, gi):
                    for i in piece.segments:
                        assert set(spans[i].sources) <= held[piece.trainer], (group, i, piece.trainer)
                    own = torch.zeros_like(buffer)
                    mine = {n: tensors[n] for n in held[piece.trainer]}
                    packers[piece.trainer].pack(c, group, mine, own, list(piece.segments))
                    buffer[piece.lo : piece.hi] = own[piece.lo : piece.hi]
                unpacker.apply(group, buffer)
            expected_slots(params, placement, slots, c, tensors)
            for name, t in params.items():
                assert not torch.isnan(t.float()).any(), (version, c, name)
    assert schedules[2] == schedules[1]  # the same placements: the cached schedule


def test_per_placement_schedules_and_old_versions_do_not_pile_up_in_the_control_store():
    """Each new set of placements makes a schedule (MiBs of JSON for a big model): over many rebalances the
    Coordinator keeps only the last KEPT_SCHEDULES published, and a placement seen again recently reuses its own. The
    keys every version leaves (announcement, results, placements, marks) are deleted two versions later."""
    import json

    from shardplan.plan.names import expert_of
    from shardplan.runtime.shards import ep_shards
    from shardplan.sync import Coordinator, SyncConfig, spans_of
    from shardplan.sync.control import announce_key, join, placement_key, result_key
    from shardplan.sync.placement import EplbPacker, publish_placement, slot_spans
    from shardplan.sync.schedule import KEPT_SCHEDULES
    from shardplan.transport import Control, consumer_name, trainer_name

    plan_file, real = eplb_plan_file()
    slots, plans = plan_file.header.eplb, [plan_file.rank(r) for r in plan_file.ranks]
    control = Control.serve("127.0.0.1")
    packer = EplbPacker(plans, plan_file.sources, slots, control, timeout_s=5)
    coordinator = Coordinator(
        control, spans_of(packer), packer.groups(), 2, SyncConfig(timeout_s=5), eplb=slot_spans(packer)
    )
    held = {t: set() for t in (0, 1)}
    for s in ep_shards({m.name: m for m in real}, 2, expert_of, slots.num_logical_experts):
        held[s.rank].add(s.name)
    for t in (0, 1):
        join(control, trainer_name(t), frozenset(held[t]))
    for c in plan_file.ranks:
        join(control, consumer_name(c))
    ids = []
    for version, seed in enumerate([*range(2 * KEPT_SCHEDULES), 2 * KEPT_SCHEDULES - 2], start=1):
        for c in plan_file.ranks:
            publish_placement(control, version, consumer_name(c), random_placement(slots, seed))
        ann = coordinator.announce(version)
        for name, epoch in ann.members.items():
            control.set(result_key(version, name), json.dumps({"ok": True, "epoch": epoch, "errors": {}}))
        ids.append(ann.schedule_id)
        published = [sid for sid in dict.fromkeys(ids) if control.try_get(f"schedule/{sid}") is not None]
        assert ann.schedule_id in published and len(published) <= KEPT_SCHEDULES, (version, published)
    assert ids[-1] == ids[-3]  # the placement of two versions ago: its schedule, still kept
    coordinator._forgetting.join(10)
    last = len(ids)
    for version in range(1, last + 1):
        keys = [announce_key(version), placement_key(version, "consumer0"), result_key(version, "trainer1")]
        present = [k for k in keys if control.try_get(k) is not None]
        assert present == (keys if version >= last - 1 else []), (version, present)
