"""A consumer checks the EPLB placement its trainers bound to against the one its engine published: a placement key
overwritten between the consumer's publish and the trainers' read (a forged placement with its digest recomputed)
fails that version by name (PlacementNotBound, naming the trainer), and the next version, bound to what the engine
published, passes. Without the control channel's secret the overwrite is refused outright (ControlForged)."""

from datetime import timedelta

import pytest
import torch

from shardplan.plan.placement import EplbSlots, make_placement
from shardplan.sync.control import placement_key, version_keys
from shardplan.sync.placement import (
    PlacementNotBound,
    check_bound,
    publish_placement,
    read_placement,
    record_bound,
)
from shardplan.transport import Control, ControlForged

SLOTS = EplbSlots(4, 2, 2, (1, 2))
REAL = make_placement([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 0, 0]], SLOTS)
FORGED = make_placement([[3, 2, 1, 0, 3, 2], [0, 1, 2, 3, 1, 1]], SLOTS)


def _trainers_bind(control: Control, version: int) -> None:
    """What each trainer lane does before packing consumer0 (TrainerSync._lane: EplbPacker.begin, record_bound)."""
    for trainer in ("trainer0", "trainer1"):
        record_bound(control, version, trainer, "consumer0", read_placement(control, version, "consumer0", SLOTS, 5))


def test_a_forged_placement_fails_the_version_by_name_and_the_next_repairs():
    control = Control.serve("127.0.0.1")
    publish_placement(control, 3, "consumer0", REAL)  # the engine's
    publish_placement(control, 3, "consumer0", FORGED)  # overwritten by someone holding the secret, digest recomputed
    _trainers_bind(control, 3)
    with pytest.raises(PlacementNotBound, match=r"^trainer0: bound consumer0's slots of version 3 to EPLB placement"):
        check_bound(control, 3, "consumer0", ("trainer0", "trainer1"), REAL, 5.0)
    publish_placement(control, 4, "consumer0", REAL)
    _trainers_bind(control, 4)
    check_bound(control, 4, "consumer0", ("trainer0", "trainer1"), REAL, 5.0)  # the next version repairs


def test_without_the_secret_the_placement_cannot_be_overwritten():
    control = Control.serve("127.0.0.1")
    publish_placement(control, 3, "consumer0", REAL)
    raw = torch.distributed.TCPStore(control.host, control.port, is_master=False, timeout=timedelta(seconds=10))
    raw.set(placement_key(3, "consumer0"), FORGED.to_json())
    raw.get(placement_key(3, "consumer0"))  # the overwrite has landed (a TCPStore set is not acknowledged)
    with pytest.raises(ControlForged, match=r"v3/placement/consumer0"):
        read_placement(control, 3, "consumer0", SLOTS, 5.0)


def test_the_bound_keys_are_forgotten_with_their_version():
    class Schedule:
        groups, trainers, consumers = ("layers.1",), (0, 1), (0,)

        def of(self, c, gi):
            return ()

    keys = set(version_keys(3, (), Schedule()))
    assert {"v3/bound/trainer0/consumer0", "v3/bound/trainer1/consumer0"} <= keys
