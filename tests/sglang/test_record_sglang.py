"""Recording SGLang's loaders + replay == SGLang's real `load_weights`, bit for bit (shardplan.record.sglang).

Hypothesis draws, per built-in model (shrunk by the vLLM tests' `shrink_overrides`) and a tiny Qwen3 dense config, an
SGLang layout: TP 1/2/4; for MoE models an EP size dividing TP (MoE-TP is the rest); for MoE/MLA models DP attention
(attention over TP/dp ranks); PP 1/2 for dense models; plus a rank, a dtype and a checkpoint seed. Each case records
the rank on the meta device and checks it with `verify_rank`: SGLang builds the rank's model twice on the CPU, every
floating-point parameter, persistent buffer and tensor attribute NaN-poisoned; one runs SGLang's `load_weights`, the
other the plan through the reference interpreter, then SGLang's own `post_load_weights` (DeepSeek's derived MLA
w_kc/w_vc); everything bitwise equal. On top: every checkpoint name is exactly one of recorded / fallback / not
needed, no fallbacks, no param the plan writes left NaN, and under EP every expert tensor is read by exactly the ranks
SGLang's expert placement gives it (one per MoE-TP rank of its EP rank).
"""

from __future__ import annotations

import pathlib
import re

import pytest
from arch_sessions import fp8_overrides, shrink_overrides
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardplan.plan import ir
from shardplan.plan.layout import Layout
from shardplan.record import verify
from shardplan.record.sglang.build import SglangLayoutRejected
from shardplan.record.sglang.options import SglangOptions
from shardplan.record.sglang.session import SglangRecordSession
from shardplan.record.sglang.verify import verify_rank

QWEN3_TINY = str(pathlib.Path(__file__).resolve().parent / "qwen3-tiny")
MOE = ("kimi-k2", "deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "glm-4.5", "mixtral-8x7b")
DENSE = ("llama-3.1-8b", "qwen2.5-7b", QWEN3_TINY)
MLA = ("kimi-k2", "deepseek-v3")
_SESSIONS: dict = {}


def overrides(model: str) -> list[str]:
    return [] if model == QWEN3_TINY else shrink_overrides(model)


def session(
    model: str, layout: Layout, options: SglangOptions, dtype: str = "bfloat16", extra: tuple = ()
) -> SglangRecordSession:
    key = (model, layout, options, dtype, extra)
    if key not in _SESSIONS:
        _SESSIONS[key] = SglangRecordSession(
            model, layout, dtype=dtype, options=options, overrides=[*overrides(model), *extra]
        )
    return _SESSIONS[key]


def check(s: SglangRecordSession, rank: int, seed: int) -> ir.RankPlan:
    plan, _ = s.record_rank(rank)
    checkpoint = verify.random_checkpoint(s.tensors, seed)
    verdict = verify_rank(s.builder, rank, plan, checkpoint)
    assert verdict.ok, f"rank {rank}: replay != SGLang's load_weights for {verdict.mismatched}"
    assert verdict.num_params >= 5
    read = plan.sources_read()
    names = [n for n, _, _ in s.tensors]
    fallback = {f.source for f in plan.fallbacks}
    assert not fallback, plan.fallbacks
    assert set(names) == read | set(plan.not_needed) and not (read & set(plan.not_needed))
    return plan


@st.composite
def layouts(draw):
    model = draw(st.sampled_from(MOE + DENSE), label="model")
    tp = draw(st.sampled_from([1, 2, 4]), label="tp")
    ep = dp = pp = 1
    if model in MOE:
        ep = draw(st.sampled_from([d for d in (1, 2, 4) if tp % d == 0]), label="ep_size")
        dp = draw(st.sampled_from([d for d in (1, 2) if tp % d == 0 and tp // d >= 1]), label="dp_attention")
    else:
        pp = draw(st.sampled_from([1, 2]), label="pp")
    layout = Layout(tp=tp, pp=pp, ep=ep > 1)
    return model, layout, SglangOptions(ep_size=ep, dp_size=dp)


@settings(max_examples=24)
@given(case=layouts(), data=st.data())
def test_replay_equals_sglang_load_weights(case, data):
    model, layout, options = case
    dtype = data.draw(st.sampled_from(["bfloat16", "float16"]), label="dtype")
    try:
        s = session(model, layout, options, dtype)
        rank = data.draw(st.integers(0, layout.world_size - 1), label="rank")
        check(s, rank, data.draw(st.integers(0, 2**16), label="seed"))
    except SglangLayoutRejected:  # SGLang's own refusal (e.g. attention heads over TP), named
        assume(False)


@pytest.mark.parametrize("model, tp, ep", [("deepseek-v3-fp8", 2, 2), ("kimi-k2-fp8", 4, 1)])
def test_block_fp8_records_and_verifies(model, tp, ep):
    s = SglangRecordSession(
        model, Layout(tp=tp, ep=ep > 1), options=SglangOptions(ep_size=ep), overrides=fp8_overrides(model)
    )
    assert s.quantizer == "fp8-e4m3-block-amax448-v1/128x128"
    for rank in range(tp):
        plan = check(s, rank, 7 + rank)
        dtypes = {p.name: p.dtype for p in plan.params}
        assert "float8_e4m3fn" in dtypes.values() and any(n.endswith("weight_scale_inv") for n in dtypes)


def test_ep_reads_every_expert_on_the_ranks_sglang_places_it():
    """Qwen3-MoE (4 experts) at TP4 with ep_size 2: MoE-TP 2, so EP rank e = tp_rank // 2 holds experts 2e, 2e+1,
    each TP-sliced over the 2 ranks of its MoE-TP group."""
    s = session("qwen3-30b-a3b", Layout(tp=4, ep=True), SglangOptions(ep_size=2))
    readers: dict[str, set[int]] = {}
    for rank in range(4):
        plan, _ = s.record_rank(rank)
        for name in plan.sources_read():
            readers.setdefault(name, set()).add(rank)
    experts = {n: r for n, r in readers.items() if ".experts." in n}
    assert experts
    for name, ranks in experts.items():
        e = int(re.search(r"experts\.(\d+)\.", name).group(1))
        assert ranks == {2 * (e // 2), 2 * (e // 2) + 1}, (name, ranks)


def test_dp_attention_shards_attention_over_attention_tp():
    """DeepSeek-V3 at TP4 with DP attention 2: attention TP is 2, so ranks 0 and 2 read the same attention rows."""
    s = session("deepseek-v3", Layout(tp=4, ep=True), SglangOptions(ep_size=4, dp_size=2))
    plans = [s.record_rank(r)[0] for r in range(4)]

    def boxes(plan, name):
        return sorted(
            (w.src.region.offset, w.src.region.sizes)
            for w in plan.writes
            if isinstance(w.src.leaf, ir.Source) and w.src.leaf.name == name
        )

    name = "model.layers.0.self_attn.q_b_proj.weight"
    assert boxes(plans[0], name) == boxes(plans[2], name) != boxes(plans[1], name)


def test_harness_fails_wrong_plans():
    """verify_rank must fail a plan with a dropped write, and one with a shifted source."""
    s = session(QWEN3_TINY, Layout(tp=2), SglangOptions())
    plan, _ = s.record_rank(1)
    checkpoint = verify.random_checkpoint(s.tensors, 0)
    dropped = ir.RankPlan(plan.rank, plan.params, plan.writes[1:], plan.fallbacks, plan.not_needed)
    assert not verify_rank(s.builder, 1, dropped, checkpoint).ok
    i = next(i for i, w in enumerate(plan.writes) if w.src.region.offset > 0)
    w = plan.writes[i]
    shifted = w.__class__(
        w.param,
        w.dst,
        w.src.__class__(
            w.src.leaf, w.src.region.__class__(w.src.region.offset - 1, w.src.region.sizes, w.src.region.strides)
        ),
    )
    bad = ir.RankPlan(
        plan.rank, plan.params, plan.writes[:i] + (shifted,) + plan.writes[i + 1 :], plan.fallbacks, plan.not_needed
    )
    assert not verify_rank(s.builder, 1, bad, checkpoint).ok


def test_post_load_weights_is_deferred_and_rerun():
    """The recording defers DeepSeek's post_load_weights (a derived tensor is no loader write): w_kc / w_vc are not
    plan params, yet verify compares them (they are re-derived from the replayed kv_b_proj)."""
    s = session("deepseek-v3", Layout(tp=2), SglangOptions())
    plan = check(s, 0, 1)
    assert not any("w_kc" in p.name or "w_vc" in p.name for p in plan.params)
    model = s.builder.build(0, "cpu")
    assert "model.layers.0.self_attn.w_kc" not in dict(model.named_parameters())


def test_layouts_sglang_refuses_are_named():
    with pytest.raises(SglangLayoutRejected, match="rank 0 of tp8"):
        SglangRecordSession("llama-3.1-8b", Layout(tp=8), overrides=shrink_overrides("llama-3.1-8b")).record_rank(0)
