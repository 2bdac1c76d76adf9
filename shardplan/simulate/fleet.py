"""The machines a simulated sync runs on: link parameters (`Links`) and where every rank sits (`Fleet`).

Model of the hardware (what the discrete-event engine charges for, and nothing else):
  * every GPU has four ports: NVLink out/in (`nvlink_GBps` each way, to GPUs of its node) and network out/in (its own
    NIC, `nic_GBps` each way, capped by the GPU<->NIC PCIe path `pcie_GBps`); the fabric between NICs is non-blocking
    (rail-optimised fat tree): a transfer between nodes is limited only by the sender's and the receiver's NIC;
  * concurrent transfers share a port max-min fairly (a fluid model, recomputed whenever a transfer starts or ends);
  * each transfer pays a fixed latency (`nvlink_latency_us` / `nic_latency_us`) before its bytes flow;
  * packing and applying are kernels on the GPU's one compute stream, at `pack_GBps` / `apply_GBps` of packed bytes;
  * each process has one CPU thread that posts (Python's GIL: the lanes of a trainer take turns): `post_us` per NCCL
    send/recv posted, `launch_us` per pack/apply enqueued, `poll_us` to notice a finished transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from shardplan.errors import ShardplanError


class SimulationError(ShardplanError):
    """Base class of the simulator's user-facing errors."""


class LinkParameterError(SimulationError, ValueError):
    """A link or rate parameter is zero, negative or not a number."""


class FleetError(SimulationError):
    """The fleet cannot hold the layouts (more ranks than GPUs, a GPU given twice, a node count below one)."""


class CoverageError(SimulationError):
    """The trainer layout does not hold some byte a consumer rank needs."""


class UnreachableConsumerError(SimulationError):
    """A consumer rank needs bytes from trainers it has no link to."""


@dataclass(kw_only=True, frozen=True)
class Links:
    """Link and rate parameters. Defaults: the 2 x H200 machine's measured ceilings for NVLink, PCIe, pack and apply,
    fixed costs read off the sync bench's trace, and a 400 Gb/s NIC per GPU (ConnectX-7 class) for the network;
    where each figure comes from: docs/benchmarks.md, "The simulator's calibrated defaults"."""

    nvlink_GBps: float = 370.0
    """NVLink bandwidth per GPU, each direction (an NCCL send/recv between two H200s)."""
    nvlink_latency_us: float = 5.0
    """Fixed cost of one transfer between GPUs of one node before its bytes flow."""
    nic_GBps: float | None = 50.0
    """Network bandwidth of each GPU's own NIC, each direction (line rate). None: no network
    (only GPUs of one node can reach each other)."""
    nic_latency_us: float = 5.0
    """Fixed cost of one transfer between nodes (RDMA round trip, NCCL proxy) before its bytes flow."""
    pcie_GBps: float = 55.0
    """GPU <-> NIC path (PCIe Gen5 x16, pinned host <-> device); caps the NIC's useful rate."""
    pack_GBps: float = 1650.0
    """Packed bytes per second of the trainer's pack (replay) kernels (H200, recorded plans; the replay bench counts
    bytes read + written, twice the packed bytes)."""
    apply_GBps: float = 1760.0
    """Packed bytes per second of the consumer's apply kernels (H200, recorded plans)."""
    post_us: float = 50.0
    """CPU time to post one NCCL send or receive."""
    launch_us: float = 20.0
    """CPU time to enqueue one pack or apply (a bound CUDA graph launch)."""
    poll_us: float = 25.0
    """Delay between a transfer finishing and its waiter noticing (the engine polls)."""
    start_us: float = 100.0
    """From the driver's "go" until a rank's sync() starts."""
    finish_us: float = 60.0
    """After a consumer's last apply: commit the version and write its result on the control channel."""
    overlap_slowdown: float = 0.0
    """Fraction of a GPU's link rate lost while a pack or apply kernel runs on that GPU (SM and memory contention);
    0 models none (the calibration sets it from the sync bench's trace: simulate/calibration.py)."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "nic_GBps" and value is None:
                continue
            if f.name == "overlap_slowdown":
                if not (isinstance(value, (int, float)) and 0 <= value < 1):
                    raise LinkParameterError(f"Links.overlap_slowdown must be in [0, 1), got {value!r}")
                continue
            positive = f.name.endswith("GBps")  # a bandwidth must be > 0; a fixed cost may be 0 (not modelled)
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0 or (positive and value == 0):
                raise LinkParameterError(
                    f"Links.{f.name} must be {'> 0' if positive else '>= 0'}, got {value!r}: "
                    f"a rate of zero or less would make every transfer on it last forever"
                )

    @property
    def network_GBps(self) -> float | None:
        """What a GPU's network port delivers: its NIC, capped by the PCIe path to it."""
        return None if self.nic_GBps is None else min(self.nic_GBps, self.pcie_GBps)


@dataclass(frozen=True)
class Fleet:
    """Where each rank runs: trainer rank t on GPU `trainer_gpus[t]`, consumer rank c on `consumer_gpus[c]`, a GPU
    being (node, local index). Build one with `disaggregated` (trainers and inference on separate nodes, the usual RL
    set-up) or `pair` (one trainer GPU and one consumer GPU of one node: the measured bench)."""

    trainer_gpus: tuple[tuple[int, int], ...]
    consumer_gpus: tuple[tuple[int, int], ...]
    gpus_per_node: int

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise FleetError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        seen: dict[tuple[int, int], str] = {}
        for role, gpus in (("trainer", self.trainer_gpus), ("consumer", self.consumer_gpus)):
            for rank, gpu in enumerate(gpus):
                if not 0 <= gpu[1] < self.gpus_per_node:
                    raise FleetError(
                        f"{role} rank {rank}: GPU {gpu[1]} of node {gpu[0]} is outside the node's "
                        f"{self.gpus_per_node} GPUs"
                    )
                if gpu in seen:
                    raise FleetError(
                        f"{role} rank {rank} is placed on node {gpu[0]} GPU {gpu[1]}, which already "
                        f"runs {seen[gpu]}: one rank per GPU"
                    )
                seen[gpu] = f"{role} rank {rank}"

    @classmethod
    def disaggregated(
        cls,
        trainer_nodes: int,
        inference_nodes: int,
        gpus_per_node: int = 8,
        num_trainers: int | None = None,
        num_consumers: int | None = None,
    ) -> "Fleet":
        """Trainer ranks fill nodes 0..trainer_nodes-1 in rank order, consumer ranks the next inference_nodes nodes."""
        if trainer_nodes < 1 or inference_nodes < 1 or gpus_per_node < 1:
            raise FleetError(
                f"node counts and gpus_per_node must be >= 1, got trainer_nodes={trainer_nodes}, "
                f"inference_nodes={inference_nodes}, gpus_per_node={gpus_per_node}"
            )
        num_trainers = trainer_nodes * gpus_per_node if num_trainers is None else num_trainers
        num_consumers = inference_nodes * gpus_per_node if num_consumers is None else num_consumers
        for role, n, nodes in (("trainer", num_trainers, trainer_nodes), ("consumer", num_consumers, inference_nodes)):
            if n > nodes * gpus_per_node:
                raise FleetError(
                    f"{n} {role} ranks do not fit on {nodes} nodes of {gpus_per_node} GPUs; add nodes "
                    f"or use a smaller layout"
                )
        return cls(
            tuple(divmod(t, gpus_per_node) for t in range(num_trainers)),
            tuple((trainer_nodes + c // gpus_per_node, c % gpus_per_node) for c in range(num_consumers)),
            gpus_per_node,
        )

    @classmethod
    def pair(cls) -> "Fleet":
        """Trainer rank 0 on GPU 0, consumer rank 0 on GPU 1 of one node (the 2 x H200 bench)."""
        return cls(((0, 0),), ((0, 1),), 2)

    @property
    def num_nodes(self) -> int:
        return 1 + max(n for n, _ in self.trainer_gpus + self.consumer_gpus)

    def describe(self) -> str:
        trainer_nodes = len({n for n, _ in self.trainer_gpus})
        consumer_nodes = len({n for n, _ in self.consumer_gpus})
        return (
            f"{len(self.trainer_gpus)} trainer GPUs on {trainer_nodes} node(s) -> {len(self.consumer_gpus)} "
            f"inference GPUs on {consumer_nodes} node(s) ({self.gpus_per_node} GPUs per node)"
        )
