"""The simulator against the measured 2 x H200 syncs (bench/sync_bench.py, logs in bench/results/).

Each measured case is one trainer GPU and one consumer GPU (rank 0 of the layout) over NVLink. The simulator gets
what was measured in the same run and nothing fitted to the sync times it is compared with:
  * the link rate: that run's raw NCCL send of the same bytes (`raw`), as bytes / time;
  * pack and apply rates: the replay bench's CUDA-graph figures for the same recorded plan
    (bench/results/replay_h200.json; GB/s there count bytes read + written, so packed bytes move at half);
  * the slowdown of a transfer while a pack or apply runs on its GPUs: from the engine's trace of the same design
    (bench/results/sync_h200_trace.log): how much longer a part's receive interval is with pack and apply running,
    over the share of the transfer the kernels cover (the figures: docs/benchmarks.md);
  * fixed costs (posting, polling, start and finish) from `Links`' defaults, read off the same trace.
The plans are the shipped plan files, restricted to the bench's layers; their bytes equal the bench's (checked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shardplan.plan.file.format import PlanFile
from shardplan.simulate import workload
from shardplan.simulate.fleet import Fleet, Links
from shardplan.simulate.run import simulate

H200_NVLINK_OVERLAP_SLOWDOWN = 0.11
"""Link rate lost while a pack/apply kernel runs on an H200 at either end (see the module docstring)."""


@dataclass(frozen=True)
class Case:
    name: str  # the case in bench/results/sync_h200.json
    plan: str  # the plan file in plans/
    layers: range  # the decoder layers the bench moved
    replay_case: str  # the matching recorded-plan case of bench/results/replay_h200.json


CASES = (
    Case(
        "kimi-ep",
        "kimi-k2--tp32-ep--bfloat16.plan",
        range(1, 4),
        "kimi-k2--tp32-ep--bfloat16 layer 1 rank 0 (recorded)",
    ),
    Case("kimi", "kimi-k2--tp32--bfloat16.plan", range(1, 4), "kimi-k2--tp32--bfloat16 layer 1 rank 0 (recorded)"),
    Case(
        "llama",
        "llama-3.1-70b--tp8--bfloat16.plan",
        range(0, 8),
        "llama-3.1-70b--tp8--bfloat16 layer 1 rank 0 (recorded)",
    ),
)


@dataclass
class Calibration:
    case: str
    nbytes: int
    link_GBps: float
    measured_ms: dict[str, float]  # "raw", "sharded", "e2e"
    simulated_ms: dict[str, float]  # "sharded" (pack and apply off), "e2e"

    def error(self, what: str) -> float:
        """Simulated over measured, minus one (positive: the simulator is slower than the machine)."""
        return self.simulated_ms[what] / self.measured_ms[what] - 1


def measured_rows(root: Path) -> tuple[dict, dict]:
    sync = {(r["case"], r["what"]): r for r in json.loads((root / "bench/results/sync_h200.json").read_text())}
    replay = {
        r["case"]: r
        for r in json.loads((root / "bench/results/replay_h200.json").read_text())["rows"]
        if r["strategy"] == "batched+graph"
    }
    return sync, replay


def calibrate(case: Case, root: Path) -> Calibration:
    sync, replay = measured_rows(root)
    raw = sync[(case.name, "raw")]
    work = workload.whole_tensors(PlanFile.read(root / "plans" / case.plan), ranks=[0], layers=case.layers)
    nbytes = sum(work.consumer_bytes().values())
    if nbytes != raw["useful_bytes"]:
        raise AssertionError(
            f"{case.name}: the plan's layers {case.layers} hold {nbytes} bytes for rank 0, the bench "
            f"moved {raw['useful_bytes']}: not the same case"
        )
    link_GBps = raw["useful_bytes"] / raw["seconds"] / 1e9
    rates = replay[case.replay_case]
    e2e_links = Links(
        nvlink_GBps=link_GBps,
        pack_GBps=rates["pack_gbps"] / 2,
        apply_GBps=rates["apply_gbps"] / 2,
        overlap_slowdown=H200_NVLINK_OVERLAP_SLOWDOWN,
    )
    # the bench's "sharded" run switches pack and apply off: the engine still enqueues nothing and posts the same
    bare_links = Links(nvlink_GBps=link_GBps, pack_GBps=1e9, apply_GBps=1e9, launch_us=0.0)
    simulated = {
        what: simulate(work, Fleet.pair(), links, rate_quantum_s=0.0).seconds * 1e3
        for what, links in (("sharded", bare_links), ("e2e", e2e_links))
    }
    measured = {what: sync[(case.name, what)]["seconds"] * 1e3 for what in ("raw", "sharded", "e2e")}
    return Calibration(case.name, nbytes, link_GBps, measured, simulated)
