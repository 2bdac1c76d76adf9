"""The plan: what one consumer rank needs from the checkpoint, and its meaning.

    plan/         the language       ir (the records), interp (their meaning: the reference interpreter), names,
                                     layout, placement (EPLB slots); template (skeletons and index tries), body
                                     (PlanBody, templated), columns (a rank's writes as numpy columns), rowkeys,
                                     overlap; inspect (`shardplan inspect`)
    plan/file/    the plan file      format, checks, skeletons, bounds, errors, rank (one rank, as columns), store
    plan/compile/ the compiler       compiler (recordings -> body), simplify, extend (rank classes), rankblocks

Nothing here imports vLLM: a trainer loads, checks and instantiates plans with this package alone.
"""
