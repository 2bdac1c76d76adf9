"""The compiler, used only at recording: per-rank recordings -> one templated plan body (compiler), computed writes
rewritten into pure views (simplify), a few recorded ranks extended to every rank of a layout (extend, rankblocks)."""
