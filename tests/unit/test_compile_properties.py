"""The compiler without vLLM: synthetic plans that look like a loader's compile, encode, decode and instantiate back
to their direct form; index tries round-trip (tests/integration/test_compile.py does the same on real recordings)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import canonical, instantiate

from shardplan.plan import ir
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file.format import decode, encode
from shardplan.plan.layout import Layout
from shardplan.plan.template import build_trie, iter_trie


# ---- pure templating, synthetic plans (no vLLM) -------------------------------------------------------------
@st.composite
def synthetic_plans(draw):
    """Writes that look like a loader's: per layer, per expert, TP-sliced by rank, with random irregularities."""
    num_ranks = draw(st.integers(1, 4))
    num_layers = draw(st.integers(1, 5))
    num_experts = draw(st.integers(1, 6))
    rows, cols = 4 * num_ranks, draw(st.integers(1, 5))
    ep = draw(st.booleans())
    irregular = draw(st.sets(st.tuples(st.integers(0, num_ranks - 1), st.integers(0, num_layers - 1)), max_size=3))
    plans = []
    sources = {}
    for rank in range(num_ranks):
        writes, params = [], {}
        for layer in range(num_layers):
            experts = [e for e in range(num_experts) if not ep or e % num_ranks == rank]
            param = f"model.layers.{layer}.experts.w13"
            params[param] = ir.TensorMeta(param, (num_experts, 8, cols), "bfloat16")
            for slot, e in enumerate(experts):
                for j, proj in enumerate(("gate", "up")):
                    src = f"model.layers.{layer}.experts.{e}.{proj}.weight"
                    sources[src] = ir.TensorMeta(src, (rows, cols), "bfloat16")
                    offset = 0 if ep else 4 * rank * cols
                    if (rank, layer) in irregular:
                        offset = (offset + cols) % (rows * cols - 4 * cols + 1)  # breaks the affine pattern
                    writes.append(
                        ir.Write(
                            param,
                            ir.Region((slot * 8 + 4 * j) * cols, (4, cols), (cols, 1)),
                            ir.View(ir.Source(src), ir.Region(offset, (4, cols), (cols, 1))),
                        )
                    )
            norm = f"model.layers.{layer}.norm.weight"
            sources[norm] = ir.TensorMeta(norm, (cols,), "float32")
            params[norm] = ir.TensorMeta(norm, (cols,), "float32")
            writes.append(ir.Write(norm, ir.full_region((cols,)), ir.View(ir.Source(norm), ir.full_region((cols,)))))
        if draw(st.booleans()):  # a constant fill, and a duplicate write
            writes.append(
                ir.Write(norm, ir.Region(0, (1,), (1,)), ir.View(ir.Full(0.0, (1,), "float32"), ir.full_region((1,))))
            )
            writes.append(writes[0])
        draw(st.randoms()).shuffle(writes)
        plans.append(ir.RankPlan(rank, tuple(params.values()), tuple(writes)))
    return plans, list(sources.values())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(synthetic_plans())
def test_instantiate_equals_direct_on_synthetic_plans(case):
    plans, sources = case
    data = encode(
        compile_plans(plans, sources),
        model="m",
        architecture="A",
        config_sha256="0" * 64,
        layout=Layout(tp=len(plans)),
        dtype="bfloat16",
        vllm_version="0",
    )
    header, body = decode(data)
    for plan in plans:
        assert instantiate(body, plan.rank) == canonical(plan)


@given(st.sets(st.tuples(st.integers(0, 6), st.integers(-1, 9), st.integers(0, 20)), min_size=1, max_size=60))
def test_index_trie_roundtrip(tuples):
    ordered = sorted(tuples)
    assert list(iter_trie(build_trie(ordered))) == ordered
