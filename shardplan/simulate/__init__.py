"""Fleet-scale sync simulator: the engine's real schedule and pipelining rules, on links you describe.

    from shardplan.plan.file.format import PlanFile
    from shardplan.simulate import Fleet, Links, simulate, trainers, workload

    plan_file = PlanFile.read("plans/kimi-k2--tp32-ep--bfloat16.plan")
    shards = trainers.megatron(plan_file.sources, num_layers=61, pp=8, tp=8, ep=32)      # 256 trainer GPUs
    work = workload.sharded(plan_file, shards, replicas=4, layers=range(8))              # 4 engines = 128 GPUs
    result = simulate(work, Fleet.disaggregated(32, 16, 8), Links(nic_GBps=50))
    print(result.format())     # sync time, speed of light, critical path, port utilisation

Pure Python + numpy on top of shardplan.sync (build_schedule) and the plan files; no vLLM, no GPU. What it models
and what it leaves out: docs/scale.md. Calibration against the measured H200 syncs: shardplan/simulate/calibration.py.
"""

from __future__ import annotations

from shardplan.simulate import trainers, workload
from shardplan.simulate.fleet import (
    CoverageError,
    Fleet,
    FleetError,
    LinkParameterError,
    Links,
    SimulationError,
    UnreachableConsumerError,
)
from shardplan.simulate.report import SimResult, SpeedOfLight
from shardplan.simulate.run import extrapolate, simulate
from shardplan.simulate.workload import Workload

__all__ = [
    "CoverageError",
    "Fleet",
    "FleetError",
    "LinkParameterError",
    "Links",
    "SimResult",
    "SimulationError",
    "SpeedOfLight",
    "UnreachableConsumerError",
    "Workload",
    "extrapolate",
    "simulate",
    "trainers",
    "workload",
]
