"""The plan: what one consumer rank needs from the checkpoint, as data a trainer can check and replay without vLLM.

    plan/          the language     ir (the records: RankPlan, Write, View, Region, Leaf), interp (their meaning: the
                                    reference interpreter), names (the one name parser), layout (TP/PP/DP/EP ranks),
                                    placement (EPLB slots), template (write skeletons, index tries), body (the
                                    templated in-memory plan), columns (a rank's writes as numpy columns), rowkeys,
                                    overlap, inspect (`shardplan inspect`)
    plan/file/     the plan file    format (bytes <-> body, sealed), checks (every field), skeletons, bounds (every
                                    box), errors, rank (one rank, as columns), store (find a plan by fingerprint)
    plan/compile/  the compiler     compiler (recordings -> body), simplify, extend + rankblocks (rank classes)

A plan names operations and regions, never code: `ir.ALLOWED_OPS` closes the ops, `ir.ITEMSIZE` the dtypes, and
`interp.apply_reference` says what every write means; every fast path (plan/file/rank.py's columns, runtime/) is
tested against it.

The compiler runs only at recording (record/ imports it); a trainer imports the language and plan/file/ (the front
`shardplan.plan.file`: `load_plan`, `PlanFile`), which import nothing of the compiler.

Nothing here imports vLLM, transformers or safetensors (tests/unit/test_planfile.py loads every module with them
blocked).
"""
