"""Fake vLLM parallel state for one rank of any layout, in one process, without torch.distributed.

Every `get_*_group()` in vllm.distributed.parallel_state reads a module global at call time, so assigning fake
GroupCoordinator objects to those globals makes model construction and weight loading behave exactly as on that rank
(the loaders ask for tp rank/size, EP rank/size, PP stage). `fake_parallel_state` saves and restores the globals, so
many ranks can be recorded one after another in one process, and nothing leaks into a real engine.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

from shardplan.plan.layout import Layout

_GLOBALS = (
    "_WORLD",
    "_INNER_DP_WORLD",
    "_NODE_COUNT",
    "_TP",
    "_ETP",
    "_ENGRAM_DP",
    "_DCP",
    "_PP",
    "_DP",
    "_EP",
    "_EPLB",
    "_PCP",
)


class _FakeProcessGroup:
    """Stands in for a torch ProcessGroup: construction only asks for .size()/.rank()."""

    def __init__(self, ranks: list[int], rank: int):
        self._ranks, self._rank = ranks, rank

    def size(self) -> int:
        return len(self._ranks)

    def rank(self) -> int:
        return self._ranks.index(self._rank)


def _fake_group(name: str, ranks: list[int], rank: int):
    from vllm.distributed.parallel_state import GroupCoordinator

    group = object.__new__(GroupCoordinator)  # __init__ would create real process groups
    group.unique_name = f"shardplan_fake_{name}"
    group.rank = rank
    group.ranks = list(ranks)
    group.group_ranks = [list(ranks)]
    group.world_size = len(ranks)
    group.rank_in_group = group.ranks.index(rank)
    group.local_rank = rank
    group.device_index = rank
    group.cpu_group = _FakeProcessGroup(group.ranks, rank)
    group.device_group = _FakeProcessGroup(group.ranks, rank)
    group.device = torch.device("cpu")
    group.torch_distributed_backend = "gloo"
    group.use_device_communicator = False
    group.device_communicator = None
    group.mq_broadcaster = None
    group.use_custom_op_call = False
    group.use_cpu_custom_send_recv = False
    group._pending_isends = deque()
    return group


@contextlib.contextmanager
def fake_parallel_state(layout: Layout, rank: int):
    """Within the block, vLLM sees itself as global `rank` of `layout`. Restores the previous state on exit."""
    import vllm.distributed.parallel_state as ps

    saved = {name: getattr(ps, name, None) for name in _GLOBALS}
    try:
        dp_rank, pp_rank, tp_rank = layout.coords(rank)
        tp, pp, dp = layout.tp, layout.pp, layout.dp
        world = list(range(layout.world_size))
        stage_base = dp_rank * pp * tp
        ps._WORLD = _fake_group("world", world, rank)
        ps._INNER_DP_WORLD = None
        ps._NODE_COUNT = 1
        ps._TP = _fake_group("tp", [stage_base + pp_rank * tp + i for i in range(tp)], rank)
        ps._ETP = ps._TP
        ps._ENGRAM_DP = None
        ps._PP = _fake_group("pp", [stage_base + i * tp + tp_rank for i in range(pp)], rank)
        ps._DP = _fake_group(
            "dp", [layout.rank_of(dp_rank=i, pp_rank=pp_rank, tp_rank=tp_rank) for i in range(dp)], rank
        )
        ps._DCP = _fake_group("dcp", [rank], rank)
        ps._PCP = _fake_group("pcp", [rank], rank)
        ps._EP = _fake_group("ep", layout.ep_ranks(rank), rank)
        ps._EPLB = None
        yield
    finally:
        for name, value in saved.items():
            setattr(ps, name, value)
