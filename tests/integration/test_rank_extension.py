"""Whole-layout recording with rank extension (record/ranks.py, plan/compile/extend.py) against recording every rank,
with vLLM's real loaders on shrunk models: the plan files must be byte-identical, across TP / DP / PP / EP layouts."""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardplan.plan.layout import Layout
from shardplan.record.build import LayoutRejected
from shardplan.record.session import RecordSession

SHRUNK = {  # small dims; vocab 500 leaves padding rows on the last TP rank(s): a rank dependence that is not affine
    "llama-3.1-8b": [
        "num_hidden_layers=4",
        "hidden_size=64",
        "intermediate_size=128",
        "num_attention_heads=8",
        "num_key_value_heads=4",
        "vocab_size=500",
    ],
    "qwen3-30b-a3b": [
        "num_hidden_layers=4",
        "hidden_size=64",
        "intermediate_size=128",
        "moe_intermediate_size=32",
        "num_attention_heads=8",
        "num_key_value_heads=8",
        "head_dim=8",
        "num_experts=12",
        "num_experts_per_tok=2",
        "vocab_size=512",
    ],
    "kimi-k2": [
        "num_hidden_layers=4",
        "hidden_size=64",
        "intermediate_size=128",
        "moe_intermediate_size=16",
        "n_routed_experts=10",
        "num_attention_heads=8",
        "num_key_value_heads=8",
        "q_lora_rank=16",
        "kv_lora_rank=16",
        "qk_rope_head_dim=8",
        "qk_nope_head_dim=8",
        "v_head_dim=8",
        "vocab_size=500",
        "num_experts_per_tok=2",
    ],
}
EXPERTS = {"llama-3.1-8b": 0, "qwen3-30b-a3b": 12, "kimi-k2": 10}


@functools.cache
def _session(model: str, layout: Layout, extra: tuple[str, ...] = ()) -> RecordSession | None:
    try:
        return RecordSession(model, layout, overrides=SHRUNK[model] + list(extra))
    except LayoutRejected:
        return None


def _both(model: str, layout: Layout, extra: tuple[str, ...] = ()):
    session = _session(model, layout, extra)
    if session is None:
        return None
    ranks = list(range(layout.world_size))
    try:
        extended = session.record_plans(ranks)
        exhaustive = session.record_plans(ranks, exhaustive=True)
    except LayoutRejected:
        return None
    return session, extended, exhaustive


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(SHRUNK)),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 3, 4]),
    st.sampled_from([1, 2]),
    st.booleans(),
)
def test_extended_recording_is_byte_identical_to_recording_every_rank(model, tp, dp, pp, ep):
    ep = ep and EXPERTS[model] > 0
    assume(tp * dp * pp <= 12 and (not ep or tp * dp <= EXPERTS[model]))
    got = _both(model, Layout(tp=tp, dp=dp, pp=pp, ep=ep))
    assume(got is not None)  # vLLM rejects the layout for this model
    session, extended, exhaustive = got
    assert session.encode(extended.body) == session.encode(exhaustive.body), extended.how
    assert [s.rank for s in extended.stats] == list(range(tp * dp * pp))


def test_a_wide_layout_records_three_ranks_and_the_rest_is_extended():
    """Kimi-K2 (shrunk, 16 experts, no padding rows) TP 8 + EP: three ranks recorded, five predicted, byte-identical;
    and with kv heads replicated over TP ranks and padding rows on the last rank (Llama, 4 kv heads at TP 8, vocab
    500), the line does not hold and more ranks are recorded, still identical."""
    session, extended, exhaustive = _both("kimi-k2", Layout(tp=8, ep=True), ("n_routed_experts=16", "vocab_size=512"))
    assert "ranks 0-1,7 recorded (3 of 8)" in extended.how, extended.how
    assert session.encode(extended.body) == session.encode(exhaustive.body)
    assert [s.tier for s in extended.stats].count("extended") == 5
    session, extended, exhaustive = _both("llama-3.1-8b", Layout(tp=8))
    assert "check(s) failed" in extended.how, extended.how
    assert session.encode(extended.body) == session.encode(exhaustive.body)


def test_uneven_expert_split_keeps_each_ranks_param_shapes():
    """10 experts over EP 4: ranks 0-1 stack 3 local experts, ranks 2-3 two. The plan file declares each rank's
    params with the shapes that rank's loader has (one shared shape per name gave ranks 2-3 the 3-expert shape),
    extended or exhaustive, through encode and decode."""
    from reference import canonical

    from shardplan.plan.file.format import PlanFile, decode

    session, extended, exhaustive = _both("kimi-k2", Layout(tp=4, ep=True))
    assert session.encode(extended.body) == session.encode(exhaustive.body), extended.how
    plan_file = PlanFile(*decode(session.encode(extended.body)))
    shapes = set()
    for rank in range(4):
        recorded = canonical(session.record_rank(rank)[0])
        got = plan_file.rank(rank)
        assert got.params == recorded.params, rank
        assert tuple(got.writes) == recorded.writes, rank
        shapes |= {p.shape for p in got.params if p.name.endswith("experts.w2_weight")}
    assert {s[0] for s in shapes} == {2, 3}
