"""Templating is exact: instantiating a compiled (and encoded/decoded) plan gives back the direct recording."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from arch_sessions import shrink_overrides
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from reference import canonical

from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file.format import PlanFile, decode, encode
from shardplan.plan.layout import Layout

# ---- real vLLM loaders ------------------------------------------------------------------------------------
SHRUNK = {
    "llama-3.1-8b": [
        "num_hidden_layers=6",
        "hidden_size=128",
        "intermediate_size=256",
        "num_attention_heads=8",
        "num_key_value_heads=4",
        "vocab_size=500",
    ],
    "qwen3-30b-a3b": [
        "num_hidden_layers=5",
        "hidden_size=128",
        "intermediate_size=256",
        "moe_intermediate_size=64",
        "num_attention_heads=8",
        "num_key_value_heads=4",
        "head_dim=16",
        "num_experts=8",
        "num_experts_per_tok=2",
        "vocab_size=512",
    ],
    "kimi-k2": [
        "num_hidden_layers=5",
        "hidden_size=128",
        "intermediate_size=256",
        "moe_intermediate_size=32",
        "n_routed_experts=8",
        "num_attention_heads=8",
        "num_key_value_heads=8",
        "q_lora_rank=32",
        "kv_lora_rank=16",
        "qk_rope_head_dim=8",
        "qk_nope_head_dim=16",
        "v_head_dim=16",
        "vocab_size=500",
        "num_experts_per_tok=2",
    ],
}


@functools.cache
def _session(model: str, tp: int, ep: bool):
    from shardplan.record.session import RecordSession

    return RecordSession(model, Layout(tp=tp, ep=ep), overrides=SHRUNK[model])


@functools.cache
def _recorded(model: str, tp: int, ep: bool):
    session = _session(model, tp, ep)
    plans = [session.record_rank(r)[0] for r in range(tp)]
    return plans, encode(
        compile_plans(plans, session.sources),
        model=model,
        architecture="x",
        config_sha256=session.spec.config_sha256,
        layout=session.layout,
        dtype="bfloat16",
        vllm_version="0.32.0",
    )


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


# the shrunk qwen3-next of the arch tests at 12 layers, 3 of them full attention
_QWEN3_NEXT = [
    {"num_hidden_layers": "num_hidden_layers=12", "full_attention_interval": "full_attention_interval=4"}.get(
        o.split("=", 1)[0], o
    )
    for o in shrink_overrides("qwen3-next-80b-a3b")
]


@pytest.mark.parametrize(
    "model, overrides",
    [
        ("qwen3-next-80b-a3b", _QWEN3_NEXT),  # linear_attn.conv1d.weight: three writes of one source into one param
        (str(Path(__file__).parent / "archs" / "mamba"), ["num_hidden_layers=4"]),  # in_proj.weight: two
    ],
)
def test_sampled_recording_with_a_source_written_twice_into_one_param(model, overrides, monkeypatch):
    """Writes that share their variables are split into groups by a hole; when that hole was the layer, each group held
    one layer and extend_layers copied layer 0's writes under layer 0's names to its whole class: the shipped
    qwen3-next-80b-a3b TP4 plan missed conv1d.weight of 31 of its 36 linear-attention layers. Such a recording is
    exhaustive now, byte-identical to recording every layer. The compiler's coalesce now merges those writes into one
    (sampling then holds), so the guard is exercised with coalesce off; with it on, sampled == exhaustive too."""
    from shardplan.plan.compile import simplify
    from shardplan.record.session import RecordSession

    merged = RecordSession(model, Layout(tp=1), overrides=overrides)
    got = merged.record_plans(range(1))
    assert got.how.startswith("sampled"), got.how
    assert merged.encode(got.body) == merged.encode(
        RecordSession(model, Layout(tp=1), overrides=overrides).record_plans(range(1), exhaustive=True).body
    )
    monkeypatch.setattr(simplify, "coalesce", list)
    got = RecordSession(model, Layout(tp=1), overrides=overrides).record_plans(range(1))
    assert "holds layer 0 without layer" in got.how, got.how
    exhaustive = RecordSession(model, Layout(tp=1), overrides=overrides)
    direct = exhaustive.record_plans(range(1), exhaustive=True)
    assert exhaustive.encode(got.body) == exhaustive.encode(direct.body)


def test_extension_that_drops_writes_falls_back_to_every_layer(monkeypatch):
    """The post-extension check alone (the sampling guard disabled) catches the qwen3-next bug: a declared param left
    without writes sends the recording back to every layer, byte-identical to exhaustive."""
    from shardplan.plan.compile import simplify
    from shardplan.record import session as session_mod

    monkeypatch.setattr(simplify, "coalesce", list)  # the writes the guard is about stay apart (as before coalesce)
    monkeypatch.setattr(session_mod, "layer_split_templates", lambda body, classes: None)
    got = session_mod.RecordSession("qwen3-next-80b-a3b", Layout(tp=2), overrides=_QWEN3_NEXT).record_plans(range(2))
    assert "extension check failed" in got.how and "conv1d.weight" in got.how, got.how
    exhaustive = session_mod.RecordSession("qwen3-next-80b-a3b", Layout(tp=2), overrides=_QWEN3_NEXT)
    assert exhaustive.encode(got.body) == exhaustive.encode(exhaustive.record_plans(range(2), exhaustive=True).body)
