"""shardplan: record an inference engine's weight loaders once, replay each rank's exact bytes at every sync.

The front: `from shardplan import load_plan, Replayer, Applier, EngineSync, ...`. Each name is imported from its home
on first use (PEP 562), so `import shardplan` costs nothing and a name costs what its own module costs; none of them
imports vLLM, SGLang, transformers or safetensors (the trainer side needs torch, msgpack and numpy only).
__init__.pyi declares the same names for type checkers and IDEs.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it (its one home)
_FRONT = {
    # plans: find, read, instantiate one rank
    "load_plan": "shardplan.plan.file.store",
    "PlanFile": "shardplan.plan.file.format",
    "PlanNotFound": "shardplan.plan.file.store",
    "StalePlan": "shardplan.plan.file.store",
    # replay on the trainer, apply on the consumer
    "Replayer": "shardplan.runtime.replay",
    "QuantizingReplayer": "shardplan.runtime.quantize",
    "Applier": "shardplan.runtime.apply",
    "params_from_plan": "shardplan.runtime.apply",
    # live engines, driven from the trainer
    "EngineSync": "shardplan.engine.trainer",
    "ModuleSource": "shardplan.engine.trainer",
    "TrainerRank": "shardplan.engine.trainer",
    "dtensor_shards": "shardplan.engine.sharding",
    "SyncConfig": "shardplan.sync.stages",
    "SyncIncomplete": "shardplan.engine.errors",
    # every error shardplan raises derives from this
    "ShardplanError": "shardplan.errors",
}

__all__ = ["__version__", *_FRONT]


def __getattr__(name: str):
    home = _FRONT.get(name)
    if home is None:
        raise AttributeError(f"module 'shardplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FRONT))
