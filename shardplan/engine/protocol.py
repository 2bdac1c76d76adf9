"""What the trainer side sends the engine's `shardplan` backend: the init and update info, as plain dataclasses
(no vLLM here; the backend subclasses them into vLLM's WeightTransferInitInfo / WeightTransferUpdateInfo).

Both travel as JSON-able dicts: over collective_rpc, Ray, or the HTTP routes of `vllm serve`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

BACKEND = "shardplan"  # the name under which the plugin registers the backend (--weight-transfer-config)
STATE_RPC = "shardplan_state"  # the worker RPC method the plugin adds (shardplan.engine.plugin)


def state_key(consumer: str) -> str:
    """Where each worker leaves its state (version, complete, error, ...) on the sync's control channel at the end of
    every update: the driver reads every consumer's there, since one handle over several engine cores (data
    parallelism) answers each RPC with the first core's reply only."""
    return f"engine/state/{consumer}"


@dataclass
class EngineInitInfo:
    """Sent once, to every worker, by init_weight_transfer_engine."""

    control_host: str = ""
    """Host and port of the sync's control channel (shardplan.transport.Control, hosted by the driver)."""
    control_port: int = 0
    control_secret: str = field(default="", repr=False)
    """The control channel's secret (hex, Control.secret_hex): every value read or written is sealed with it."""
    transport: str = "nccl"
    """A shardplan.transport name: on CPU `nccl` runs over gloo; `mooncake:tcp`; ... (docs/transports.md)."""
    transport_options: dict[str, Any] = field(default_factory=dict)
    plan_path: str = ""
    """The plan file as the workers see it. Empty: found by fingerprint (shardplan.plan.file.store.load_plan) from the
    live engine's model config, layout and dtype."""
    plan_sha256: str = ""
    """The trainer's plan file sha256 (PlanFile.digest): the worker refuses a different plan."""
    timeout_s: float = 30.0
    announce_timeout_s: float = 600.0
    verify: bool = True
    max_group_bytes: int = 256 << 20
    """Pipeline unit; must equal the trainer's (shardplan.sync.PART_BYTES by default)."""
    check_config: bool = True
    """Compare the plan's config sha256 with the engine's model config (turn off only for a model whose config the
    engine reads from somewhere shardplan cannot, e.g. a hub id not cached here)."""

    trainer_shards: dict[str, list] = field(default_factory=dict)
    """Sharded trainers: every trainer rank's box of each checkpoint tensor ({name: [[rank, [start, stop, ...]]]},
    shardplan.engine.sharding.shards_to_json); the workers re-plan their writes against them as the trainers do.
    Empty: the trainers hold whole tensors."""
    errors_in_state: bool = False
    """A refusal returns and waits in the worker's state (STATE_RPC, "init_error") instead of raising: see
    EngineUpdateInfo.errors_in_state."""
    replica: int = 0
    """Which replica of the plan's layout this engine is, when one EngineSync feeds several (EngineSync(replicas=N));
    its workers join the sync as consumer `replica * world + plan rank` (shardplan.sync.Replicas)."""
    replicas: int = 1
    """How many replicas the sync feeds (EngineSync(replicas=N)); 1: this engine's consumer ids are its plan ranks."""
    dp_replicas: int = 1
    """How many replicas this one engine hosts as vLLM data-parallel ranks (a dense model's DP ranks run as
    independent engine cores, each of data_parallel_size 1): DP index i is replica `replica + i`."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EngineUpdateInfo:
    """Sent per sync, to every worker, by update_weights."""

    version: int = 0
    rerun_moe_prepack: bool = True
    """Re-run the CPU MoE experts' prepack that vLLM 0.32 skips on updates (shardplan.engine.reload). Leave it on;
    the regression test turns it off once to show the bug it works around."""
    defer_gemm: bool = True
    """Build an embedding's or lm_head's CPU GEMM handle at its first logits call after the update rather than in it,
    unless a logits call was seen (shardplan.engine.reload.DeferredGemm). Off: every one built in the update, as
    vLLM's own reload does (bench/engine_bench.py compares the two)."""
    receive_in_place: bool = True
    """Receive a segment that is one contiguous range of one param straight into the materialized param, where the
    sync's pool has room for its module (shardplan.engine.reload.ReloadUnpacker.receive_targets), rather than into the
    receive buffer and then copying it. Off: every byte through the buffer (bench/engine_bench.py compares the two)."""
    prefault_pool: bool = True
    """Fault the sync's materialize pool in when it is allocated, in a thread beside the first transfers (Linux
    MADV_POPULATE_WRITE), rather than by the first receive or apply into it."""
    keep_pool: bool = False
    """Memory for speed, off by default: keep the materialize pool (about one decoder layer) allocated and faulted in
    between updates, so the next update neither allocates nor faults it in; the engine holds it while serving."""
    errors_in_state: bool = False
    """A failed update returns and leaves its error in the worker's state (STATE_RPC) instead of raising. EngineSync
    sets it: once one worker of vLLM's multiproc executor (TP >= 2) raises, the executor stops reading the later
    workers' replies and every later call of that engine gets a stale one (docs/engine.md)."""
