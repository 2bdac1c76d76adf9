"""Which plan rank a vLLM worker is (shardplan.engine.backend.worker_plan_rank): vLLM's (DP index, PP stage, TP rank),
numbered as the plan's world, one plan rank per worker; a dense model's DP replica (vLLM runs it as an engine of
data_parallel_size 1 that keeps its DP index) is the plan's rank of replica offset = its DP index when the driver
said the engine hosts that many replicas, and refused by name otherwise (never mapped past the plan's ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import vllm.distributed.parallel_state as parallel_state

from shardplan.engine.backend import engine_layout, worker_plan_rank
from shardplan.engine.errors import EnginePlanMismatch


def _config(tp=1, pp=1, dp=1, dp_index=0):
    return SimpleNamespace(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        enable_expert_parallel=False,
        data_parallel_index=dp_index,
        data_parallel_rank=dp_index,
    )


@pytest.mark.parametrize("tp, pp, dp", [(2, 1, 1), (1, 2, 1), (2, 2, 2), (4, 1, 2)])
def test_every_worker_is_one_plan_rank(monkeypatch, tp, pp, dp):
    ranks = []
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                monkeypatch.setattr(parallel_state, "get_pp_group", lambda p=p: SimpleNamespace(rank_in_group=p))
                monkeypatch.setattr(parallel_state, "get_tp_group", lambda t=t: SimpleNamespace(rank_in_group=t))
                config = _config(tp, pp, dp, d)
                layout = engine_layout(config)
                offset, rank = worker_plan_rank(config, layout)
                ranks.append(rank)
                assert offset == 0 and layout.coords(rank) == (d, p, t)
    assert sorted(ranks) == list(range(tp * pp * dp))


def test_a_dense_models_dp_replica_is_a_replica_or_refused_by_name(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(rank_in_group=1))
    # what vLLM leaves a dense model's DP rank 1 (reconfigure_for_independent_dp_rank)
    config = _config(tp=2, dp=1, dp_index=1)
    assert worker_plan_rank(config, engine_layout(config), dp_replicas=2) == (1, 1)
    with pytest.raises(EnginePlanMismatch, match=r"data-parallel rank 1 .*independent engines.*replicas=<DP size"):
        worker_plan_rank(config, engine_layout(config))
