"""The compiler: per-rank recordings -> one templated plan body (plan/body.py). Used at recording only.

    compile_plans(plans, sources) := canonicalise (drop empty, merge duplicates, keep overlapping writes in recording
                                     order; simplify.py rewrites repeat-only computed writes into pure views)
                                     -> flatten each write to (skeleton, integers) (plan/template.py)
                                     -> fit each skeleton's integers as affine functions of (rank, layer, name ints),
                                        splitting a group where a hole does not fit (compiler.split_by_rank)
    extend / rankblocks           := the same body from a few recorded ranks, predicted along rank classes

Templating is exact: instantiating any rank of the body gives the rank's recording back, write for write
(tests/integration/test_compile.py, tests/unit/test_compile_properties.py).

record/session.py drives it; sampled recording (a few layers, a few ranks) must give the same bytes as recording
everything (tests/unit/test_extend_ranks.py, bench/compile_bench.py).

Nothing outside record/ imports this package: a trainer never compiles.
"""
