"""shardplan inside a live vLLM engine (docs/engine.md).

Engine side (imports vLLM): `backend` (the `shardplan` weight-transfer backend), `plugin` (its registration, a
`vllm.general_plugins` entry point), `reload` (plan bytes into the pre-processing params under layerwise reload).
Trainer side (no vLLM): `trainer` (EngineSync, TrainerRank, ModuleSource), `clients` (LLM / Ray / HTTP handles),
`protocol` (the init and update info), `errors`.
"""
