"""Templating is exact: instantiating a compiled (and encoded/decoded) plan gives back the direct recording."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from reference import canonical, instantiate

from shardplan.plan import ir
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file.format import PlanFile, decode, encode
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
                    writes.append(ir.Write(param, ir.Region((slot * 8 + 4 * j) * cols, (4, cols), (cols, 1)),
                                           ir.View(ir.Source(src), ir.Region(offset, (4, cols), (cols, 1)))))
            norm = f"model.layers.{layer}.norm.weight"
            sources[norm] = ir.TensorMeta(norm, (cols,), "float32")
            params[norm] = ir.TensorMeta(norm, (cols,), "float32")
            writes.append(ir.Write(norm, ir.full_region((cols,)), ir.View(ir.Source(norm), ir.full_region((cols,)))))
        if draw(st.booleans()):  # a constant fill, and a duplicate write
            writes.append(ir.Write(norm, ir.Region(0, (1,), (1,)), ir.View(ir.Full(0.0, (1,), "float32"),
                                                                        ir.full_region((1,)))))
            writes.append(writes[0])
        draw(st.randoms()).shuffle(writes)
        plans.append(ir.RankPlan(rank, tuple(params.values()), tuple(writes)))
    return plans, list(sources.values())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(synthetic_plans())
def test_instantiate_equals_direct_on_synthetic_plans(case):
    plans, sources = case
    data = encode(compile_plans(plans, sources), model="m", architecture="A", config_sha256="0" * 64,
                  layout=Layout(tp=len(plans)), dtype="bfloat16", vllm_version="0")
    header, body = decode(data)
    for plan in plans:
        assert instantiate(body, plan.rank) == canonical(plan)


@given(st.sets(st.tuples(st.integers(0, 6), st.integers(-1, 9), st.integers(0, 20)), min_size=1, max_size=60))
def test_index_trie_roundtrip(tuples):
    ordered = sorted(tuples)
    assert list(iter_trie(build_trie(ordered))) == ordered


# ---- real vLLM loaders ------------------------------------------------------------------------------------
SHRUNK = {
    "llama-3.1-8b": ["num_hidden_layers=6", "hidden_size=128", "intermediate_size=256", "num_attention_heads=8",
                     "num_key_value_heads=4", "vocab_size=500"],
    "qwen3-30b-a3b": ["num_hidden_layers=5", "hidden_size=128", "intermediate_size=256", "moe_intermediate_size=64",
                      "num_attention_heads=8", "num_key_value_heads=4", "head_dim=16", "num_experts=8",
                      "num_experts_per_tok=2", "vocab_size=512"],
    "kimi-k2": ["num_hidden_layers=5", "hidden_size=128", "intermediate_size=256", "moe_intermediate_size=32",
                "n_routed_experts=8", "num_attention_heads=8", "num_key_value_heads=8", "q_lora_rank=32",
                "kv_lora_rank=16", "qk_rope_head_dim=8", "qk_nope_head_dim=16", "v_head_dim=16", "vocab_size=500",
                "num_experts_per_tok=2"],
}


@functools.cache
def _session(model: str, tp: int, ep: bool):
    from shardplan.record.session import RecordSession

    return RecordSession(model, Layout(tp=tp, ep=ep), overrides=SHRUNK[model])


@functools.cache
def _recorded(model: str, tp: int, ep: bool):
    session = _session(model, tp, ep)
    plans = [session.record_rank(r)[0] for r in range(tp)]
    return plans, encode(compile_plans(plans, session.sources), model=model, architecture="x",
                         config_sha256=session.spec.config_sha256, layout=session.layout, dtype="bfloat16",
                         vllm_version="0.32.0")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(SHRUNK)), st.sampled_from([1, 2, 4]), st.booleans(), st.data())
def test_instantiate_equals_direct_recording(model, tp, ep, data):
    assume(not ep or model != "llama-3.1-8b")
    plans, encoded = _recorded(model, tp, ep)
    plan_file = PlanFile(*decode(encoded))
    rank = data.draw(st.integers(0, tp - 1), label="rank")
    got = plan_file.rank(rank)
    want = canonical(plans[rank])
    assert got.writes == want.writes and got.params == want.params
    # and per layer, the instantiated writes are exactly those recorded for that layer
    layer = data.draw(st.integers(0, 4), label="layer")
    key = f"layers.{layer}."
    assert [w for w in got.writes if key in w.param] == [w for w in want.writes if key in w.param]
    assert set(plan_file.not_needed(rank)) == set(plans[rank].not_needed)


def test_sampled_recording_is_byte_identical_to_exhaustive():
    from shardplan.record.session import RecordSession

    overrides = SHRUNK["kimi-k2"][1:] + ["num_hidden_layers=6"]
    for ep in (False, True):
        sampled = RecordSession("kimi-k2", Layout(tp=4, ep=ep), overrides=overrides)
        got = sampled.record_plans(range(4))
        assert got.how.startswith("sampled"), got.how
        exhaustive = RecordSession("kimi-k2", Layout(tp=4, ep=ep), overrides=overrides)
        direct = exhaustive.record_plans(range(4), exhaustive=True)
        assert direct.how == "exhaustive (asked)"
        assert sampled.encode(got.body) == exhaustive.encode(direct.body)


_QWEN3_NEXT = ["num_hidden_layers=12", "full_attention_interval=4", "hidden_size=128", "num_attention_heads=4",
               "num_key_value_heads=2", "head_dim=32", "intermediate_size=256", "moe_intermediate_size=64",
               "shared_expert_intermediate_size=64", "num_experts=4", "num_experts_per_tok=2", "linear_num_key_heads=4",
               "linear_num_value_heads=8", "linear_key_head_dim=32", "linear_value_head_dim=32", "vocab_size=300"]


@pytest.mark.parametrize("model, overrides", [
    ("qwen3-next-80b-a3b", _QWEN3_NEXT),   # linear_attn.conv1d.weight: three writes of one source into one param
    (str(Path(__file__).parent / "archs" / "mamba"), ["num_hidden_layers=4"]),   # in_proj.weight: two
])
def test_sampled_recording_with_a_source_written_twice_into_one_param(model, overrides):
    """Writes that share their variables are split into groups by a hole; when that hole was the layer, each group held
    one layer and extend_layers copied layer 0's writes under layer 0's names to its whole class: the shipped
    qwen3-next-80b-a3b TP4 plan missed conv1d.weight of 31 of its 36 linear-attention layers. Such a recording is
    exhaustive now, byte-identical to recording every layer."""
    from shardplan.record.session import RecordSession

    got = RecordSession(model, Layout(tp=1), overrides=overrides).record_plans(range(1))
    assert "holds layer 0 without layer" in got.how, got.how
    exhaustive = RecordSession(model, Layout(tp=1), overrides=overrides)
    direct = exhaustive.record_plans(range(1), exhaustive=True)
    assert exhaustive.encode(got.body) == exhaustive.encode(direct.body)


def test_extension_that_drops_writes_falls_back_to_every_layer(monkeypatch):
    """The post-extension check alone (the sampling guard disabled) catches the qwen3-next bug: a declared param left
    without writes sends the recording back to every layer, byte-identical to exhaustive."""
    from shardplan.record import session as session_mod

    monkeypatch.setattr(session_mod, "layer_split_templates", lambda body, classes: None)
    got = session_mod.RecordSession("qwen3-next-80b-a3b", Layout(tp=2), overrides=_QWEN3_NEXT).record_plans(range(2))
    assert "extension check failed" in got.how and "conv1d.weight" in got.how, got.how
    exhaustive = session_mod.RecordSession("qwen3-next-80b-a3b", Layout(tp=2), overrides=_QWEN3_NEXT)
    assert exhaustive.encode(got.body) == exhaustive.encode(exhaustive.record_plans(range(2), exhaustive=True).body)
