"""What a simulated sync says: its time next to the speed of light, how busy each link was, and the critical path."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from shardplan.simulate.engine import NET_OUT, NVLINK_OUT, PORT_NAMES, Activity, Simulation
from shardplan.simulate.fleet import Fleet, Links
from shardplan.simulate.workload import Workload


@dataclass
class SpeedOfLight:
    """Lower bounds no schedule over these links beats."""

    network_s: float
    """The busiest port's bytes over its rate (ports: each GPU's NIC out/in and NVLink out/in), for this schedule."""
    busiest_port: str
    consumer_s: float
    """The busiest consumer port's bytes over its rate: fixed by the plans, whatever the trainers do."""
    balanced_s: float
    """max(consumer_s, the bytes leaving trainers over each port class spread evenly over all trainer GPUs): the
    bound of a perfectly balanced trainer side."""
    read_s: float
    """The trainer side reading each byte the consumers need once (one copy per distinct consumer plan), spread
    evenly over every trainer GPU at the pack rate."""

    @property
    def seconds(self) -> float:
        return max(self.network_s, self.read_s)


@dataclass
class PortUse:
    port: str  # "trainer17 NIC out"
    nbytes: float
    utilisation: float  # bytes / (rate * sync time)


@dataclass
class SimResult:
    seconds: float
    """From the driver's "go" until the last consumer has applied its last group and written its result."""
    workload: Workload
    fleet: Fleet
    links: Links
    bytes_scale: float
    speed_of_light: SpeedOfLight
    ports: list[PortUse]
    activities: list[Activity]
    critical_path: list[Activity]
    consumer_end: dict[int, float]
    trainer_end: dict[int, float]
    rate_series: list[tuple[float, float, float]]
    wall_s: dict[str, float] = field(default_factory=dict)
    port_label: list[str] = field(default_factory=list)

    @property
    def num_transfers(self) -> int:
        return sum(a.kind == "transfer" for a in self.activities)

    def critical_breakdown(self) -> dict[str, float]:
        """Seconds of the critical path per kind of step; "transfer (NIC ...)" names the limiting port class;
        "overhead" is the time between steps (CPU posting, polling, link latency, the start signal)."""
        out: dict[str, float] = defaultdict(float)
        prev_end = 0.0
        for a in self.critical_path:
            out["overhead"] += max(0.0, a.start - prev_end)
            if a.kind == "transfer":
                limit = PORT_NAMES[a.port % 4] if a.port >= 0 else "latency"
                out[f"transfer (limited by {limit})"] += a.end - a.start
            elif a.kind in ("pack", "apply"):
                out[a.kind] += a.end - a.start
            prev_end = max(prev_end, a.end)
        out["overhead"] += max(0.0, self.seconds - prev_end)
        return dict(out)

    def busiest(self, n: int = 5) -> list[PortUse]:
        return sorted(self.ports, key=lambda p: -p.nbytes)[:n]

    def utilisation_by_class(self) -> dict[str, tuple[float, float]]:
        """Port class ("trainer NIC out", ...) -> (mean, max) utilisation over the ports of that class that moved
        any byte."""
        by: dict[str, list[float]] = defaultdict(list)
        for p in self.ports:
            role = "trainer" if p.port.startswith("trainer") else "consumer"
            by[f"{role} {p.port.split(' ', 1)[1]}"].append(p.utilisation)
        return {k: (float(np.mean(v)), float(np.max(v))) for k, v in sorted(by.items())}

    def format(self) -> str:
        sol = self.speed_of_light
        w = self.workload
        layers = "all layers" if w.layers is None else f"decoder layers {w.layers[0]}-{w.layers[-1]} of {w.num_layers}"
        lines = [
            f"{w.description}: {layers}" + (f", bytes x{self.bytes_scale:g}" if self.bytes_scale != 1 else ""),
            f"fleet: {self.fleet.describe()}",
            f"{len(w.groups)} groups, {self.num_transfers} transfers, "
            f"{sum(w.consumer_bytes().values()) * self.bytes_scale / 1e9:.1f} GB to consumers",
            f"sync time          {self.seconds * 1e3:10.2f} ms",
            f"speed of light     {sol.seconds * 1e3:10.2f} ms  (busiest port {sol.busiest_port}: "
            f"{sol.network_s * 1e3:.2f} ms; trainer read once {sol.read_s * 1e3:.2f} ms)",
            f"  balanced bound   {sol.balanced_s * 1e3:10.2f} ms  "
            f"(busiest consumer port {sol.consumer_s * 1e3:.2f} ms)",
            f"sync / light       {self.seconds / sol.seconds:10.2f}x",
            "critical path:",
        ]
        for kind, secs in sorted(self.critical_breakdown().items(), key=lambda kv: -kv[1]):
            lines.append(f"  {kind:<34} {secs * 1e3:10.2f} ms  {secs / self.seconds:6.1%}")
        lines.append("port utilisation (mean / max over ports that moved bytes):")
        for cls, (mean, peak) in self.utilisation_by_class().items():
            lines.append(f"  {cls:<34} {mean:6.1%} / {peak:6.1%}")
        lines.append("busiest ports: " + ", ".join(f"{p.port} {p.nbytes / 1e9:.2f} GB" for p in self.busiest(3)))
        if self.wall_s:
            lines.append("wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.wall_s.items()))
        return "\n".join(lines)


def port_labels(sim: Simulation) -> list[str]:
    owner = {g: f"trainer{t}" for t, g in sim.trainer_gpu.items()}
    owner.update({g: f"consumer{c}" for c, g in sim.consumer_gpu.items()})
    return [f"{owner.get(i // 4, f'gpu{i // 4}')} {PORT_NAMES[i % 4]}" for i in range(len(sim.port_bytes))]


def summarise(sim: Simulation, workload: Workload, wall_s: dict[str, float]) -> SimResult:
    labels = port_labels(sim)
    seconds = max(sim.consumer_end.values(), default=0.0)
    caps = sim.base_caps
    used = np.flatnonzero(sim.port_bytes > 0)
    ports = (
        [PortUse(labels[i], float(sim.port_bytes[i]), float(sim.port_bytes[i] / (caps[i] * seconds))) for i in used]
        if seconds > 0
        else []
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        port_s = np.where(caps > 0, sim.port_bytes / caps, 0.0)
    busiest = int(np.argmax(port_s)) if len(port_s) else 0
    is_consumer = np.zeros(len(caps), dtype=bool)
    for g in sim.consumer_gpu.values():
        is_consumer[4 * g : 4 * g + 4] = True
    consumer_s = float(port_s[is_consumer].max(initial=0.0))
    # the trainer side perfectly balanced: each class of out-port (NIC, NVLink) carries what it carried in this run,
    # spread evenly over every trainer GPU's port of that class
    trainer_gpus = list(sim.trainer_gpu.values())
    trainer_bound = 0.0
    for port in (NET_OUT, NVLINK_OUT):
        idx = [4 * g + port for g in trainer_gpus]
        total, cap = float(sim.port_bytes[idx].sum()), float(caps[idx].sum())
        if total:
            trainer_bound = max(trainer_bound, total / cap)
    distinct = {}
    for c, r in workload.plan_rank.items():
        distinct.setdefault(r, sum(s.nbytes for segs in workload.layouts[c].values() for s in segs))
    read_s = sum(distinct.values()) * sim.scale / (max(1, len(workload.trainers)) * sim.links.pack_GBps * 1e9)
    sol = SpeedOfLight(float(port_s[busiest]), labels[busiest], consumer_s, max(consumer_s, trainer_bound), read_s)
    path = critical_path(sim.activities, sim, seconds)
    return SimResult(
        seconds,
        workload,
        sim.fleet,
        sim.links,
        sim.scale,
        sol,
        ports,
        sim.activities,
        path,
        dict(sim.consumer_end),
        dict(sim.trainer_end),
        sim.rate_series,
        wall_s,
        labels,
    )


def critical_path(activities: list[Activity], sim: Simulation, seconds: float) -> list[Activity]:
    """Follow causes back from the last consumer's end; returned in time order."""
    ends = [i for i, a in enumerate(activities) if a.kind == "end" and a.end >= seconds - 1e-12]
    if not ends:
        return []
    path, i = [], ends[0]
    while i is not None:
        path.append(activities[i])
        i = activities[i].cause
    return path[::-1]
