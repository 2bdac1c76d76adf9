"""Recording: what vLLM's real weight loaders do, captured as a plan (docs/recording.md).

    RecordSession(model, layout).record_plans() := per rank: build the model on the meta device (build, parallel)
                                                -> load_weights with recording tensors (loader; fast, full tiers)
                                                -> the writes it made (hooks, recording, rectensor)
                                                -> compile all ranks (plan/compile/) -> plan file (plan/file/)
    verify                                      := replay == vLLM's real loader, bitwise, on random tensors

Model configs are read through transformers' config classes (configs), checkpoint names as save_pretrained writes
them (checkpoint); block-FP8 checkpoints (fp8) and EPLB slots (eplb) are recorded the same way.

Sampled recording records a few layers and ranks and extends them (ranks); the result is byte-identical to recording
everything, or recording falls back to recording more. coverage sweeps every text decoder vLLM implements.

The only stage that imports vLLM (and only inside functions where a module is also used without it).
"""
