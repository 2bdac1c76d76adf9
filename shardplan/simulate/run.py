"""simulate(): the schedule from the engine's own builder, one sync of it in the discrete-event engine, a report;
extrapolate(): a whole model from runs on its first layers."""

from __future__ import annotations

import time

from shardplan.simulate.engine import Simulation
from shardplan.simulate.fleet import Fleet, FleetError, LinkParameterError, Links, UnreachableConsumerError
from shardplan.simulate.report import SimResult, summarise
from shardplan.simulate.workload import Workload


def simulate(
    work: Workload,
    fleet: Fleet,
    links: Links | None = None,
    *,
    bytes_scale: float = 1.0,
    rate_quantum_s: float = 50e-6,
    group_order: str = "engine",
) -> SimResult:
    """Build the schedule with the engine's own builder, then run one sync of it on `fleet` over `links`.

    `bytes_scale` multiplies every byte (0.5: FP8 estimated from a BF16 plan). `rate_quantum_s`: shared link rates
    are recomputed at most this often in simulated time (0: at every transfer start and end, exact; the default
    trades a small error for speed: docs/benchmarks.md). `group_order="rotated"`: a what-if, not what
    the engine does: consumer i of n takes the groups starting at i * G // n (spreads them over PP trainer stages)."""
    links = links or Links()
    if bytes_scale <= 0:
        raise LinkParameterError(f"bytes_scale must be > 0, got {bytes_scale}")
    if rate_quantum_s < 0:
        raise LinkParameterError(f"rate_quantum_s must be >= 0, got {rate_quantum_s}")
    if work.trainers and max(work.trainers) >= len(fleet.trainer_gpus):
        raise FleetError(
            f"the trainer layout has {len(work.trainers)} ranks (up to {max(work.trainers)}) but the "
            f"fleet places {len(fleet.trainer_gpus)} trainer GPUs; add trainer nodes or shrink the layout"
        )
    unplaced = [c for c in work.consumers if c >= len(fleet.consumer_gpus)]
    if unplaced:
        raise UnreachableConsumerError(
            f"consumer ranks {unplaced[:5]}{'...' if len(unplaced) > 5 else ''} have no "
            f"GPU in the fleet ({len(fleet.consumer_gpus)} inference GPUs for "
            f"{len(work.consumers)} consumer ranks); add inference nodes"
        )
    wall = {"build workload": work.build_seconds}
    start = time.perf_counter()
    schedule = work.schedule()
    wall["build_schedule"] = time.perf_counter() - start
    start = time.perf_counter()
    sim = Simulation(
        schedule, fleet, links, bytes_scale=bytes_scale, rate_quantum_s=rate_quantum_s, group_order=group_order
    ).run()
    wall["simulate"] = time.perf_counter() - start
    return summarise(sim, work, wall)


def extrapolate(results: list[SimResult], num_layers: int) -> tuple[float, float, float]:
    """Sync time of the whole model from runs on its first k1 < k2 decoder layers: a straight line through
    (k, seconds) (the pipeline's steady state adds a fixed time per layer). Returns (seconds, per-layer seconds,
    fixed seconds). Honest only for models whose layers after the first few are alike (MoE stacks)."""
    points = sorted((len(r.workload.layers), r.seconds) for r in results if r.workload.layers)
    if len(points) < 2 or points[0][0] == points[-1][0]:
        raise ValueError("extrapolate needs runs on two different numbers of decoder layers")
    (k1, t1), (k2, t2) = points[0], points[-1]
    per_layer = (t2 - t1) / (k2 - k1)
    fixed = t1 - per_layer * k1
    return fixed + per_layer * num_layers, per_layer, fixed
