"""vLLM general plugin: registers the `shardplan` weight-transfer backend in every vLLM process (front end, engine
core, each spawned worker) through the `vllm.general_plugins` entry point in pyproject.toml. The backend module is
imported only when an engine selects it.

It also gives vLLM's worker class one read-only RPC method, `shardplan_state` (the backend's version, completeness and
last error on that worker), so that `collective_rpc("shardplan_state")` and the dev HTTP route /collective_rpc can
ask for it by name (a callable would need VLLM_ALLOW_INSECURE_SERIALIZATION=1).
"""

from __future__ import annotations

from shardplan.engine.protocol import BACKEND, STATE_RPC


def worker_state(worker) -> dict:
    """The shardplan backend's state on one vLLM worker."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None or not hasattr(engine, "state"):
        return {"rank": None, "version": None, "complete": None, "error": "the shardplan backend is not selected"}
    return engine.state()


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "shardplan.engine.backend", "ShardplanWeightTransferEngine"
        )
    except ValueError:
        pass  # vLLM may load plugins more than once per process (vllm/plugins/__init__.py)
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except ImportError:  # another vLLM layout: the state RPC is unavailable, the backend works regardless
        return
    if not hasattr(WorkerBase, STATE_RPC):
        setattr(WorkerBase, STATE_RPC, worker_state)
